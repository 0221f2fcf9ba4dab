"""4-bit weight-only (W4A16) projections from AutoAWQ and GPTQ (gptqmodel's 'gptq' format)
checkpoints against transformers with the checkpoint's dequantized weights (activations are not
quantized, so float32 agrees to float32 sums: tokens equal, logprobs within 2e-4), on every test
architecture; the unpacking against the formats' definitions; tensor parallelism; malformed
checkpoints refused by name. The Triton kernels: test_int4_kernels.py."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from bench.int4_rtn import awq_pack, gptq_pack_columns, gptq_pack_rows
from engine.models import build_model
from engine.quant.convert import set_int4_words
from engine.quant.int4 import (Int4Matmul, dequantize, from_words, pack_nibbles, to_words, unpack_awq_columns,
                               unpack_gptq_columns, unpack_gptq_rows, unpack_nibbles, words_block_n)
from tests.builders import ARCHITECTURES, assert_greedy_equals_hf, load_hf_model
from tests.quant_builders import dequantized_reference, write_int4

pytest.importorskip("transformers")

PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], [0, 5, 6, 7], list(range(40, 70))]


def test_unpacking_inverts_autoawq_and_gptq_packing() -> None:
    values = torch.randint(0, 16, (16, 40))
    assert torch.equal(unpack_awq_columns(awq_pack(values)).long(), values)
    assert torch.equal(unpack_gptq_rows(gptq_pack_rows(values)).long(), values)
    assert torch.equal(unpack_gptq_columns(gptq_pack_columns(values)).long(), values)
    assert torch.equal(unpack_nibbles(pack_nibbles(values)), values.to(torch.uint8))
    # the formats' definitions, spelled out: AWQ's nibble i is column AWQ_ORDER[i]; GPTQ's bits 4j are row j
    assert int(awq_pack(torch.arange(8).view(1, 8))) == 0x75316420
    assert int(gptq_pack_rows(torch.arange(8).view(8, 1))) == 0x76543210


def test_words_layout_places_each_nibble_and_inverts() -> None:
    """to_words (the CUDA kernel's layout): tile t, trip r, row j, word w holds column 128 r + 16 i + w
    of row t * block_n + j at nibble i; scales by tile and group; from_words gives both back."""
    q = torch.randint(0, 16, (96, 384))
    scale = torch.randn(96, 12, 2).half()
    assert words_block_n(pack_nibbles(q), scale) == 32
    weight, tiled = to_words(pack_nibbles(q), scale, 32)
    assert weight.shape == (96, 192) and tiled.shape == (96, 12, 2)
    words = weight.view(torch.int32).view(3, 3, 32, 16)
    for t, r, j, w, i in [(0, 0, 0, 0, 0), (2, 1, 5, 7, 3), (1, 2, 31, 15, 7)]:
        assert int(words[t, r, j, w] >> (4 * i) & 0xF) == int(q[32 * t + j, 128 * r + 16 * i + w])
    assert torch.equal(tiled.view(3, 12, 32, 2)[1, 4, 5], scale[32 + 5, 4])
    back = from_words(weight, tiled, 32)
    assert torch.equal(back[0], pack_nibbles(q)) and torch.equal(back[1], scale)
    # shapes the layout does not take: K not a multiple of 128, groups straddling a 16-column product
    assert words_block_n(pack_nibbles(q[:, :320]), scale[:, :10]) is None
    assert words_block_n(pack_nibbles(q), torch.zeros(96, 48, 2)) is None  # groups of 8


def test_set_int4_words_moves_the_products_the_kernel_takes_and_back(hf_checkpoints, tmp_path) -> None:
    """Only down (K = 128 here) fits the kernel's layout; moving there and back gives every byte back."""
    write_int4(hf_checkpoints("llama"), tmp_path / "awq", group=32)
    model, _ = build_model(tmp_path / "awq", torch.float32, torch.device("cpu"))
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    before = {name: t.clone() for name, t in [("down", mlp.down_proj.weight), ("down_s", mlp.down_proj.weight_scale),
                                               ("qkv", attn.qkv_weight), ("gate_up", mlp.gate_up_weight)]}
    set_int4_words(model, True)
    assert model.int4_words
    assert not torch.equal(mlp.down_proj.weight, before["down"])
    assert torch.equal(attn.qkv_weight, before["qkv"]) and torch.equal(mlp.gate_up_weight, before["gate_up"])
    set_int4_words(model, True)  # already there: unchanged
    set_int4_words(model, False)
    assert torch.equal(mlp.down_proj.weight, before["down"]) and torch.equal(mlp.down_proj.weight_scale,
                                                                              before["down_s"])


def test_reference_path_is_dequantize_then_matmul() -> None:
    q, x = torch.randint(0, 16, (24, 64)), torch.randn(3, 64)
    scale = torch.stack((torch.rand(24, 2).half(), torch.randint(0, 16, (24, 2)).half()), -1)
    w = dequantize(pack_nibbles(q), scale, torch.float32)
    want = (q.view(24, 2, 32).float() - scale[..., 1:].float()) * scale[..., :1].float()
    assert torch.equal(w, want.view(24, 64))
    torch.testing.assert_close(Int4Matmul("reference", triton=False)(x, pack_nibbles(q), scale, None), x @ w.T)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_int4_checkpoints_equal_transformers_on_their_dequantized_weights(arch, fmt, hf_checkpoints, tmp_path,
                                                                          make_llm):
    src = hf_checkpoints(arch)
    weights = write_int4(src, tmp_path / fmt, group=32, fmt=fmt)
    llm = make_llm(str(tmp_path / fmt), num_blocks=64)  # 'auto': 4-bit because config.json says so
    assert llm.engine.weights == "4-bit projections on the reference path"
    assert llm.engine.runner.model.model.layers[0].mlp.gate_up_weight.dtype == torch.uint8
    assert_greedy_equals_hf(llm, dequantized_reference(load_hf_model(src), weights), PROMPTS, 24)


def _awq_checkpoint(hf_checkpoints, tmp_path, fmt="awq"):
    write_int4(hf_checkpoints("llama"), tmp_path / fmt, group=32, fmt=fmt)
    return tmp_path / fmt


def test_missing_awq_part_is_named(hf_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.o_proj.qzeros"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj\.qweight is 4-bit \(awq\) but its qzeros tensor .* is missing"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_wrong_awq_shape_is_named(hf_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.scales"] = torch.ones(2, 64, dtype=torch.float16)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.scales has shape \(2, 64\); config\.json \(group_size 32\) "
                                         r"implies \(4, 64\)"):
        LLM(str(path), device="cpu", num_blocks=16)


@pytest.mark.parametrize("field, value, message", [
    ("bits", 3, r"quantization_config\.bits is 3; pdserve loads 4"),
    ("version", "gemv", r"quantization_config\.version is 'gemv'; pdserve loads 'gemm'"),
    ("zero_point", False, r"quantization_config\.zero_point is False"),
    ("group_size", 12, r"quantization_config\.group_size is 12"),
])
def test_unsupported_awq_config_is_named(field, value, message, hf_checkpoints, tmp_path) -> None:
    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", num_blocks=16)


@pytest.mark.parametrize("field, value, message", [
    ("desc_act", True, r"quantization_config\.desc_act is True; pdserve loads False"),
    ("checkpoint_format", "marlin", r"quantization_config\.checkpoint_format is 'marlin'"),
    ("bits", 8, r"quantization_config\.bits is 8; pdserve loads 4"),
])
def test_unsupported_gptq_config_is_named(field, value, message, hf_checkpoints, tmp_path) -> None:
    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path, "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", num_blocks=16)


def test_gptq_act_order_indices_are_refused(hf_checkpoints, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path, "gptq")
    tensors = load_file(str(path / "model.safetensors"))
    g_idx = tensors["model.layers.0.mlp.up_proj.g_idx"]
    tensors["model.layers.0.mlp.up_proj.g_idx"] = g_idx.flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.g_idx does not map input column k to group k // 32"):
        LLM(str(path), device="cpu", num_blocks=16)


def test_awq_refuses_fp8_on_top(hf_checkpoints, tmp_path) -> None:
    from engine import LLM

    path = _awq_checkpoint(hf_checkpoints, tmp_path)
    with pytest.raises(ValueError, match="4-bit \\(awq\\) checkpoint; quantization='fp8'"):
        LLM(str(path), device="cpu", num_blocks=16, quantization="fp8")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_tensor_parallel_splits_rows_and_whole_groups(fmt, hf_checkpoints, tmp_path, make_llm) -> None:
    """TP=2: q/k/v and gate/up keep their rows' values and scales, o and down their columns' (whole
    groups of 32): TP=1's tokens and logprobs (float32 sums in another order)."""
    path = str(_awq_checkpoint(hf_checkpoints, tmp_path, fmt))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    one = make_llm(path, num_blocks=64).generate(PROMPTS, params)
    llm = make_llm(path, num_blocks=64, tensor_parallel_size=2)
    assert llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight.shape == (64, 16)  # 32 of 64 columns
    two = llm.generate(PROMPTS, params)
    llm.close()
    for a, b in zip(two, one, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)


def test_tensor_parallel_that_splits_a_group_is_named(hf_checkpoints, tmp_path) -> None:
    from engine import LLM

    write_int4(hf_checkpoints("llama"), tmp_path / "g64", group=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 gives each rank 32 of o_proj's 64 input columns, "
                                         r"not whole 4-bit groups of 64"):
        LLM(str(tmp_path / "g64"), device="cpu", num_blocks=16, tensor_parallel_size=2)
