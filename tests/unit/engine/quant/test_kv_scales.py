"""Per-layer FP8 KV-cache scales read from checkpoints (engine/quant/kv_scales.py):

- every naming FP8 checkpoints use is read, and a malformed set is refused naming the tensor;
- whole models of every test architecture whose V runs far past E4M3's range (v_proj scaled up, o_proj
  down by as much: the same function), with per-layer scales in the checkpoint, against transformers
  whose attention reads K and V rounded through FP8 under those scales (tests/quant_builders);
- the cache holds K / k_scale and V / v_scale (against the same checkpoint under a unit scale), on every
  tensor-parallel rank;
- two workers pair only under the same scales, the error naming both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import SamplingParams
from engine.quant.kv_scales import fingerprint, read_kv_scales
from kvtransfer import KvLayout, LayoutMismatchError
from tests.builders import ARCHITECTURES, load_hf_model
from tests.quant_builders import count_close_sequences, count_runs_agreeing, fp8_kv_reference, scaled_kv_checkpoint

pytest.importorskip("transformers")

PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], [0, 5, 6, 7], list(range(40, 70))]
NUM_NEW = 16
V_GAIN = 3000.0  # v_proj's gain (and o_proj's loss): V values in the thousands, past E4M3's 448


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),
                                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")])
def test_scales_are_read_per_layer_in_either_naming(tmp_path, names):
    k_name, v_name = names
    a = _write(tmp_path / "a.safetensors", {f"model.layers.0.{k_name}": torch.tensor(0.5),
                                            f"model.layers.0.{v_name}": torch.tensor([2.0]),
                                            "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    b = _write(tmp_path / "b.safetensors", {f"model.layers.1.{k_name}": torch.tensor(0.25, dtype=torch.bfloat16),
                                            f"model.layers.1.{v_name}": torch.tensor(3.0)})
    assert read_kv_scales([a, b], 2) == ((0.5, 2.0), (0.25, 3.0))


def test_one_kv_scale_serves_both_and_none_means_a_unit_scale(tmp_path):
    one = _write(tmp_path / "one.safetensors", {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(1.5 + i)
                                                for i in range(2)})
    assert read_kv_scales([one], 2) == ((1.5, 1.5), (2.5, 2.5))
    none = _write(tmp_path / "none.safetensors", {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})
    assert read_kv_scales([none], 2) is None
    assert fingerprint(None) == 0
    assert fingerprint(((1.5, 1.5), (2.5, 2.5))) == 0x3B4852B3  # the same in every process: pairing compares it
    assert fingerprint(((1.5, 1.5), (2.5, 2.5))) != fingerprint(((1.5, 1.5), (2.5, 2.0)))


@pytest.mark.parametrize(("tensors", "error"), [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)},
     "not for every layer: model.layers.1.self_attn.k_scale, model.layers.1.self_attn.v_scale missing"),
    ({f"model.layers.{i}.self_attn.{n}": torch.ones(4) for i in range(2) for n in ("k_scale", "v_scale")},
     "tensor model.layers.0.self_attn.k_scale has shape (4,); a KV-cache scale is one number per layer"),
    ({f"model.layers.{i}.self_attn.{n}": torch.tensor(-1.0 if i else 1.0) for i in range(2)
      for n in ("k_scale", "v_scale")},
     "tensor model.layers.1.self_attn.k_scale is -1.0; a KV-cache scale must be positive and finite"),
    ({**{f"model.layers.{i}.self_attn.{n}": torch.tensor(1.0) for i in range(2) for n in ("k_scale", "v_scale")},
      "model.layers.0.self_attn.kv_scale": torch.tensor(1.0)},
     "names its KV-cache scales two ways: model.layers.0.self_attn.k_scale and model.layers.0.self_attn.kv_scale"),
])
def test_malformed_scales_are_refused_naming_the_tensor(tmp_path, tensors, error):
    path = _write(tmp_path / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_kv_scales([path], 2)


def test_models_with_checkpoint_kv_scales_match_transformers_reading_fp8_kv_under_them(
        hf_checkpoints, make_llm, monkeypatch, tmp_path):
    """V in the thousands (a unit scale would saturate it at 448) and per-layer scales that bring K and V
    into E4M3's range: the engine's FP8 cache agrees with transformers rounding K and V the same way."""
    scales = [(0.75, 12.0), (1.25, 20.0)]
    fp8_kv_reference(monkeypatch, scales)
    close = 0
    for arch in ARCHITECTURES:
        path = scaled_kv_checkpoint(hf_checkpoints(arch), tmp_path / arch, scales, V_GAIN)
        llm = make_llm(str(path), kv_cache_dtype="fp8", num_blocks=64)
        assert llm.engine.kv_scales == tuple(scales) and llm.engine.stats().kv_scales == "checkpoint"
        close += count_close_sequences(llm, load_hf_model(path), PROMPTS, NUM_NEW)
    total = len(ARCHITECTURES) * len(PROMPTS)
    assert close >= 0.8 * total, f"only {close} of {total} sequences within 2e-4"


def test_the_cache_holds_values_over_their_scales(hf_checkpoints, make_llm, tmp_path):
    """Scales of powers of two divide exactly: the cache under (2, 1/2) holds half and twice what the
    same checkpoint's cache holds under a unit scale (but for E4M3's subnormals), and gives its tokens.
    (Were the scales not applied, it would hold the same values.)
    A bfloat16 cache ignores the scales."""
    src = hf_checkpoints("llama3")
    scaled = scaled_kv_checkpoint(src, tmp_path / "scaled", [(2.0, 0.5), (2.0, 0.5)])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for name, path in (("unit", src), ("scaled", scaled)):
        llm = make_llm(str(path), kv_cache_dtype="fp8", num_blocks=64, enable_prefix_caching=False)
        outs = llm.generate(PROMPTS, params)
        kv = llm.engine.runner.kv_caches.view(torch.uint8).clone().view(torch.float8_e4m3fn).float()
        runs[name] = ([o.outputs[0].token_ids for o in outs], kv, llm.engine.stats().kv_scales)
    (unit_tokens, unit_kv, unit_kind), (scaled_tokens, scaled_kv, scaled_kind) = runs["unit"], runs["scaled"]
    assert (unit_kind, scaled_kind) == ("unit", "checkpoint")
    assert scaled_tokens == unit_tokens
    k_err = (scaled_kv[:, 0] * 2 - unit_kv[:, 0]).abs()
    v_err = (scaled_kv[:, 1] / 2 - unit_kv[:, 1]).abs()
    assert unit_kv[:, 0].abs().max() > 0.1 and unit_kv[:, 1].abs().max() > 0.1  # the cache was written
    # layer 0 reads the same embeddings in both: equal but for E4M3's subnormals (a step of 2^-9, 2^-8 doubled);
    # later layers read outputs those moved, so a value may round one step apart
    assert k_err[0].max() <= 2**-8 and v_err[0].max() <= 2**-9
    assert (k_err == 0).float().mean() > 0.9 and (v_err == 0).float().mean() > 0.9
    plain = make_llm(str(scaled), num_blocks=64)
    assert plain.engine.kv_scales is None and plain.engine.stats().kv_scales == ""


def test_every_tensor_parallel_rank_stores_under_the_scales(hf_checkpoints, make_llm, tmp_path):
    """TP=2 on the checkpoint whose V runs past E4M3's range: each rank's cache holds its KV heads under
    the scales (a rank under a unit scale would saturate V): TP=1's tokens up to a flip."""
    path = scaled_kv_checkpoint(hf_checkpoints("qwen3"), tmp_path / "qwen3", [(0.75, 12.0), (1.25, 20.0)], V_GAIN)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    one = make_llm(str(path), kv_cache_dtype="fp8", num_blocks=64).generate(PROMPTS, params)
    llm = make_llm(str(path), kv_cache_dtype="fp8", num_blocks=64, tensor_parallel_size=2)
    two = llm.generate(PROMPTS, params)
    llm.close()
    close = count_runs_agreeing(two, one, exact=1e-4)
    assert close >= 2, f"only {close} of {len(PROMPTS)} sequences within 1e-4"


def test_workers_pair_only_under_the_same_scales():
    mine = KvLayout(2, 16, 2, 8, "float8_e4m3fn", fingerprint(((0.5, 2.0), (1.0, 1.0))))
    assert KvLayout.from_ints(mine.to_ints()) == mine
    mine.check_compatible(KvLayout.from_ints(mine.to_ints()))
    unit = KvLayout(2, 16, 2, 8, "float8_e4m3fn")
    want = rf"scales: this worker has per-layer scales {mine.scales:#010x}, the peer has a unit scale"
    with pytest.raises(LayoutMismatchError, match=want):
        mine.check_compatible(unit)
