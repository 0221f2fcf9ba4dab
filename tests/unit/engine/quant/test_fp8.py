"""FP8 (W8A8) projections against references nobody here wrote the engine side of:

- the quantized matmul's reference path against dequantize-then-multiply in float64;
- whole models of every test architecture against transformers made W8A8 by tests/quant_builders.py
  (weights rounded through FP8 per row, or the checkpoint's own FP8 values; each projection's input
  rounded through FP8 per token), quantized at load from float32 checkpoints and read from
  compressed-tensors FP8 checkpoints (per-channel and per-tensor scales, bfloat16 scales);
- transformers' block-scaled fp8 checkpoints loaded dequantized (exactly) against transformers on
  those values, or requantized per channel with quantization='fp8';
- every malformed checkpoint refused with the tensor and the format named.

Tolerance: an activation whose float32 value lies within rounding of an FP8 rounding boundary can
round to the other side in the engine than in transformers (different orders of float32 sums); it
then moves that token's logits (and, through its KV, later ones) by up to ~0.5 nats on these random
models. So tests/quant_builders.agrees_until_a_flip: greedy tokens equal and logprobs within 2e-4
up to the first step that deviates more (which stays within 0.5), and at least 80% of sequences
without such a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import load_arch
from engine.quant.fp8 import FP8, Fp8Matmul, dequantize_rows, quantize_rows
from tests.builders import ARCHITECTURES, assert_greedy_equals_hf, load_hf_model
from tests.quant_builders import (count_close_sequences, dequantized_reference, fp8_reference,
                                  write_compressed_tensors, write_fp8_block)

pytest.importorskip("transformers")

PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], [0, 5, 6, 7], list(range(40, 70))]
NUM_NEW = 24


def test_quantize_rows_bounds_and_zero_rows() -> None:
    x = torch.randn(6, 300, dtype=torch.float64) * torch.logspace(-3, 3, 6, dtype=torch.float64)[:, None]
    x[3] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert q.float().abs().amax(-1)[[0, 1, 2, 4, 5]].eq(448).all()  # each row's largest value maps to 448
    back = dequantize_rows(q, scale, torch.float64)
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale.double() * 2**-9).all()  # half an E4M3 step, or subnormal
    assert not q[3].float().any()


def test_reference_path_equals_dequantized_matmul() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    wq, ws = quantize_rows(w)
    got = Fp8Matmul("reference", triton=False)(x, wq, ws.view(-1), b)
    xq, xs = quantize_rows(x)
    want = dequantize_rows(xq, xs, torch.float64) @ dequantize_rows(wq, ws, torch.float64).T + b.double()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got.dtype == x.dtype
    three = Fp8Matmul("reference", triton=False)(x.view(5, 1, 64), wq, ws.view(-1), None)
    assert three.shape == (5, 1, 48)
    none = Fp8Matmul("reference", triton=False)(x[:0], wq, ws.view(-1), b)  # no rows: no product to call
    assert none.shape == (0, 48) and none.dtype == x.dtype


def _compare(llm: LLM, reference: object) -> tuple[int, int]:
    """(sequences whose logprobs all agree within 2e-4, sequences)."""
    return count_close_sequences(llm, reference, PROMPTS, NUM_NEW), len(PROMPTS)


def test_models_quantized_at_load_match_w8a8_transformers(hf_checkpoints, make_llm) -> None:
    close = total = 0
    for arch in ARCHITECTURES:
        path = hf_checkpoints(arch)
        llm = make_llm(str(path), quantization="fp8", device="cpu", num_blocks=64)
        assert llm.engine.weights == llm.engine.stats().weights == "fp8 projections on the reference path"
        c, t = _compare(llm, fp8_reference(load_hf_model(path)))
        close, total = close + c, total + t
    assert close >= 0.8 * total, f"only {close} of {total} sequences within 2e-4"


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoints_load_as_published(strategy, hf_checkpoints, tmp_path, make_llm) -> None:
    close = total = 0
    for arch in ARCHITECTURES:
        src = hf_checkpoints(arch)
        dequantized = write_compressed_tensors(src, tmp_path / arch, strategy)
        llm = make_llm(str(tmp_path / arch), device="cpu", num_blocks=64)  # 'auto': FP8 because config.json says so
        q_proj = llm.engine.runner.model.model.layers[0].self_attn.q_proj
        torch.testing.assert_close(dequantize_rows(q_proj.weight, q_proj.weight_scale, torch.float32),
                                   dequantized["model.layers.0.self_attn.q_proj.weight"], atol=0, rtol=0)
        c, t = _compare(llm, fp8_reference(load_hf_model(src), dequantized))
        close, total = close + c, total + t
    assert close >= 0.8 * total, f"only {close} of {total} sequences within 2e-4"


def test_tensor_parallel_scales_row_parallel_inputs_per_rank(hf_checkpoints, tmp_path, make_llm) -> None:
    """TP=2 on an FP8 checkpoint: q/k/v and gate/up scales follow the rows a rank holds, o/down's stay
    whole; a row-parallel projection's input (a rank's columns of it) gets a scale per token per rank,
    as transformers made W8A8 with those scales computes."""
    close = total = 0
    for arch in ("llama", "qwen3"):
        src = hf_checkpoints(arch)
        dequantized = write_compressed_tensors(src, tmp_path / arch)
        llm = make_llm(str(tmp_path / arch), device="cpu", num_blocks=64, tensor_parallel_size=2)
        c, t = _compare(llm, fp8_reference(load_hf_model(src), dequantized, tensor_parallel=2))
        llm.close()
        close, total = close + c, total + t
    assert close >= 0.8 * total, f"only {close} of {total} sequences within 2e-4"


def test_quantized_at_load_holds_fp8_weights_and_scales(hf_checkpoints, make_llm) -> None:
    llm = make_llm(str(hf_checkpoints("qwen2")), quantization="fp8", device="cpu", num_blocks=16)
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == FP8 and attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.qkv_bias.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    w = load_hf_model(hf_checkpoints("qwen2")).model.layers[0].self_attn.k_proj.weight
    want_q, want_scale = quantize_rows(w)
    assert torch.equal(attn.k_proj.weight.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(attn.k_proj.weight_scale, want_scale.view(-1))


@pytest.mark.parametrize("tp", [1, 2])
def test_dummy_weights_quantize(tp: int, hf_checkpoints, make_llm) -> None:
    """At TP=2 each rank draws and quantizes its own part (4x H200, the 70B shape: a rank's q_proj
    was checked against the whole model's shape and refused)."""
    llm = make_llm(str(hf_checkpoints("llama")), quantization="fp8", load_format="dummy", device="cpu", num_blocks=16,
                   tensor_parallel_size=tp)
    down = llm.engine.runner.model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8 and (down.weight_scale > 0).all()
    assert down.weight.shape[1] == load_arch(hf_checkpoints("llama")).intermediate_size // tp
    out = llm.generate([[0, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


def _checkpoint(hf_checkpoints, tmp_path: Path) -> Path:
    write_compressed_tensors(hf_checkpoints("llama"), tmp_path / "ct")
    return tmp_path / "ct"


def _edit(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_scale_is_named(hf_checkpoints, tmp_path) -> None:
    path = _checkpoint(hf_checkpoints, tmp_path)
    _edit(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is float8_e4m3fn "
                                         r"\(compressed-tensors\) but its scale tensor .*weight_scale is missing"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_wrong_scale_shape_is_named(hf_checkpoints, tmp_path) -> None:
    path = _checkpoint(hf_checkpoints, tmp_path)
    _edit(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(3, 1)}))
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale has shape \(3, 1\); a per-channel scale of 64"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_wrong_weight_shape_is_named(hf_checkpoints, tmp_path) -> None:
    path = _checkpoint(hf_checkpoints, tmp_path)
    _edit(path, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight": torch.zeros(128, 32, dtype=FP8)}))
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(128, 32\), config\.json implies \(128, 64\)"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_fp8_tensor_without_quantization_config_is_named(hf_checkpoints, tmp_path) -> None:
    path = _checkpoint(hf_checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"is float8_e4m3fn but config\.json has no quantization_config"):
        LLM(str(path), device="cpu", num_blocks=16)


@pytest.mark.parametrize("field, value, message", [
    ("quant_method", "bitsandbytes", r"quant_method is 'bitsandbytes'; pdserve loads 'compressed-tensors' \(FP8\), "
                                     r"'fp8' \(block-scaled\), 'awq' .* and 'gptq'"),
    ("format", "pack-quantized", r"quantization_config\.format is 'pack-quantized'"),
    ("num_bits", 4, r"config_groups\.group_0\.weights\.num_bits is 4"),
    ("strategy", "group", r"config_groups\.group_0\.weights\.strategy is 'group'"),
])
def test_unknown_quantization_is_named(field, value, message, hf_checkpoints, tmp_path) -> None:
    path = _checkpoint(hf_checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization_config"]
    target = quant["config_groups"]["group_0"]["weights"] if field in ("num_bits", "strategy") else quant
    target[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", num_blocks=16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_block_scaled_fp8_loads_dequantized(arch, hf_checkpoints, tmp_path, make_llm) -> None:
    """transformers' block-scaled fp8 (a scale per 16x24 tile here, partial tiles at the edges):
    each weight times its tile's scale, exactly, in the model's dtype; transformers on those values
    gives the same tokens, logprobs within 2e-4 (activations are not quantized: no flips)."""
    src = hf_checkpoints(arch)
    dequantized = write_fp8_block(src, tmp_path / "blk", (16, 24))
    llm = make_llm(str(tmp_path / "blk"), num_blocks=64)
    assert llm.engine.weights == "float32"
    gate = llm.engine.runner.model.model.layers[1].mlp.gate_proj.weight
    assert torch.equal(gate, dequantized["model.layers.1.mlp.gate_proj.weight"])
    reference = dequantized_reference(load_hf_model(src), dequantized)
    assert_greedy_equals_hf(llm, reference, PROMPTS, NUM_NEW)


def test_block_scaled_fp8_with_quantization_fp8_requantizes_per_channel(hf_checkpoints, tmp_path, make_llm):
    dequantized = write_fp8_block(hf_checkpoints("llama"), tmp_path / "blk", (16, 24))
    llm = make_llm(str(tmp_path / "blk"), num_blocks=16, quantization="fp8")
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    want_q, want_scale = quantize_rows(dequantized["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(down.weight.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(down.weight_scale, want_scale.view(-1))


def test_block_scaled_fp8_errors_are_named(hf_checkpoints, tmp_path) -> None:
    write_fp8_block(hf_checkpoints("llama"), tmp_path / "blk", (16, 24))
    path = tmp_path / "blk"
    _edit(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale_inv": torch.ones(5, 5)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale_inv has shape \(5, 5\); weight_block_size \[16, 24\] "
                                         r"over a \(32, 64\) weight implies \(2, 3\)"):
        LLM(str(path), device="cpu", num_blocks=16)
    _edit(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=r"k_proj\.weight is float8_e4m3fn \(fp8-block\) but its scale tensor "
                                         r".*weight_scale_inv is missing"):
        LLM(str(path), device="cpu", num_blocks=16)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size is \[128\]"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_unknown_quantization_option_is_named(hf_checkpoints) -> None:
    with pytest.raises(ValueError, match="quantization") as error:
        LLM(str(hf_checkpoints("llama")), quantization="int3", device="cpu", num_blocks=16)
    assert "int3" in str(error.value), str(error.value)  # the value given, beside the field


def test_gguf_loads_quantized(hf_checkpoints, tmp_path, monkeypatch, make_llm) -> None:
    """A GGUF with quantization='fp8': each projection read as floats, then FP8 per row, like a
    safetensors checkpoint (an F32 GGUF here, so the rows are the checkpoint's exactly)."""
    pytest.importorskip("gguf")
    from tests.gguf_builders import write_gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf_checkpoints("qwen3"), tmp_path / "m.gguf")
    llm = make_llm(str(path), quantization="fp8", device="cpu", num_blocks=16)
    up = llm.engine.runner.model.model.layers[1].mlp.up_proj
    want_q, want_scale = quantize_rows(load_hf_model(hf_checkpoints("qwen3")).model.layers[1].mlp.up_proj.weight)
    assert torch.equal(up.weight.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(up.weight_scale, want_scale.view(-1))
