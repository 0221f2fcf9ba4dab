"""Builders of FP8 test checkpoints and of the reference they are compared against.

The reference is transformers' own model with each decoder projection's weight replaced by its
dequantized FP8 value and each projection's input rounded through FP8 per token (the W8A8
definition, written here from the definition, not from engine/quant/). The checkpoints are written
in the formats llm-compressor (compressed-tensors) and transformers (block-scaled `fp8`) publish.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded to scale * (an E4M3 value): saturating at +-448, to nearest even."""
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)


def per_row_scale(x: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """[rows, 1]: the row's max magnitude maps to 448 / headroom."""
    return (x.float().abs().amax(-1, keepdim=True) * headroom / 448).clamp(min=1e-10)


def is_projection(name: str) -> bool:
    return any(f".{p}." in name for p in PROJECTIONS) and name.endswith(".weight")


def fp8_round_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x [..., n] rounded through FP8 with one scale per token for each of `groups` equal parts of n."""
    parts = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    return fp8_round(parts, per_row_scale(parts)).reshape(x.shape)


def fp8_reference(model: Any, weights: dict[str, torch.Tensor] | None = None, tensor_parallel: int = 1) -> Any:
    """`model` (transformers, float32) made W8A8: each projection's input rounded through FP8 with a
    per-token scale; its weight `weights[name]` (the checkpoint's dequantized values) or, without
    `weights`, rounded through FP8 with a per-row scale. tensor_parallel: o_proj's and down_proj's
    inputs (split by columns across that many ranks) get a scale per token per rank."""
    for name, module in model.named_modules():
        part = name.rsplit(".", 1)[-1]
        if part not in PROJECTIONS:
            continue
        with torch.no_grad():
            w = module.weight
            w.copy_(weights[f"{name}.weight"] if weights is not None else fp8_round(w, per_row_scale(w)))
        groups = tensor_parallel if part in ("o_proj", "down_proj") else 1
        module.register_forward_pre_hook(lambda m, args, g=groups: (fp8_round_groups(args[0], g),))
    return model


def _copy_side_files(src: Path, out: Path, quantization_config: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))


def write_compressed_tensors(src: Path, out: Path, strategy: str = "channel", headroom: float = 1.25,
                             scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """An llm-compressor FP8 checkpoint of `src` (weights `strategy` 'channel' or 'tensor', dynamic
    per-token activations), scales with `headroom` (so they are not the ones pdserve would pick).
    Returns the projections' dequantized weights, by name."""
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    written, dequantized = {}, {}
    for name, w in tensors.items():
        if not is_projection(name):
            written[name] = w
            continue
        scale = per_row_scale(w, headroom)
        if strategy == "tensor":
            scale = scale.max().reshape(1)
        scale = scale.to(scale_dtype)
        q = (w.float() / scale.float()).clamp(-448, 448).to(FP8)
        written[name], written[name + "_scale"] = q, scale
        dequantized[name] = q.float() * scale.float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(written, str(out / "model.safetensors"))
    group = {"targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                   "dynamic": True}}
    _copy_side_files(src, out, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                "config_groups": {"group_0": group}, "ignore": ["lm_head"],
                                "quantization_status": "compressed"})
    return dequantized


def write_fp8_block(src: Path, out: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A transformers `fp8` checkpoint of `src`: weights in `block`-sized tiles, each with its own
    `weight_scale_inv` (partial tiles at the edges). Returns the dequantized weights, by name."""
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    written, dequantized = {}, {}
    br, bc = block
    for name, w in tensors.items():
        if not is_projection(name):
            written[name] = w
            continue
        rows, cols = w.shape
        tiles = torch.zeros(-(-rows // br), -(-cols // bc))
        for i in range(tiles.shape[0]):
            for j in range(tiles.shape[1]):
                tiles[i, j] = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max() / 448
        scale = tiles.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        q = (w / scale).clamp(-448, 448).to(FP8)
        written[name], written[name + "_scale_inv"] = q, tiles
        dequantized[name] = q.float() * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(written, str(out / "model.safetensors"))
    _copy_side_files(src, out, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": list(block)})
    return dequantized


def agrees_until_a_flip(got: list[int], want: list[int], deviations: list[float], exact: float,
                        bound: float = 0.5) -> bool:
    """Greedy tokens `got` against `want`, with each step's logprob deviation: True when every step
    deviates at most `exact` (all tokens then equal). An FP8 activation that rounds the other way
    (a different order of float32 sums puts it across a rounding boundary) moves that step's logprobs,
    and later ones, by up to ~0.5 on the random test models; so tokens must be equal before the first
    step that deviates more than `exact`, and that step's deviation must stay within `bound`."""
    for step, (g, w, d) in enumerate(zip(got, want, deviations, strict=True)):
        if d > exact:
            assert d <= bound, f"step {step}: logprobs deviate by {d}"
            return False
        assert g == w, f"step {step}: token {g}, reference {w}, logprobs within {exact}"
    return True


def count_runs_agreeing(got_runs: Any, want_runs: Any, exact: float) -> int:
    """Two engines' greedy outputs of the same prompts (with logprobs=1), each pair checked by
    agrees_until_a_flip; how many agreed within `exact` all along."""
    close = 0
    for a, b in zip(got_runs, want_runs, strict=True):
        got, want = a.outputs[0], b.outputs[0]
        close += agrees_until_a_flip(got.token_ids, want.token_ids,
                                     [abs(x - y) for x, y in zip(got.logprobs, want.logprobs)], exact=exact)
    return close


HF_ATTENTION_MODULES = ("llama", "mistral", "qwen2", "qwen3")


def fp8_kv_reference(monkeypatch: Any, scales: Sequence[tuple[float, float]] | None = None) -> None:
    """transformers' eager attention (of every test architecture) fed K (after rotary) and V rounded
    through FP8 E4M3 (saturating at +-448) under a unit scale, or under layer i's (k_scale, v_scale) of
    `scales` (x / scale rounded, times scale): what an FP8 KV cache holds."""
    import importlib

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)

    for name in HF_ATTENTION_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        eager = module.eager_attention_forward

        def patched(attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                    _eager: Any = eager, **kwargs: Any) -> Any:
            k_scale, v_scale = scales[attn.layer_idx] if scales is not None else (1.0, 1.0)
            return _eager(attn, query, rounded(key, k_scale), rounded(value, v_scale), *args, **kwargs)

        monkeypatch.setattr(module, "eager_attention_forward", patched)


def write_int4(src: Path, out: Path, group: int = 32, fmt: str = "awq") -> dict[str, torch.Tensor]:
    """A 4-bit checkpoint of `src`, round-to-nearest per `group` input columns, as bench/int4_rtn.py
    writes it: AutoAWQ's GEMM packing (qweight [in, out / 8], qzeros [in / group, out / 8]) or GPTQ's
    (qweight [in / 8, out], qzeros stored minus one, g_idx); scales float16 [in / group, out].
    Returns the dequantized weights, by name."""
    from bench.int4_rtn import write_int4_rtn

    return write_int4_rtn(src, out, group, fmt)


def dequantized_reference(model: Any, weights: dict[str, torch.Tensor]) -> Any:
    """`model` (transformers, float32) with the projections' weights replaced by `weights` (W4A16:
    activations untouched)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)
    return model


def count_close_sequences(llm: Any, reference: Any, prompts: list[list[int]], num_new: int,
                          exact: float = 2e-4) -> int:
    """Greedy runs of `prompts` on the engine `llm` against transformers' `reference`
    (tests.builders.hf_greedy), each checked by agrees_until_a_flip; how many agreed within `exact`
    all along."""
    from engine import SamplingParams
    from tests.builders import hf_greedy

    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, logprobs=5)
    close = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        want, want_logprobs = hf_greedy(reference, prompt, num_new)
        got = out.outputs[0]
        deviations = []
        for top, ref in zip(got.top_logprobs, want_logprobs):
            ids = torch.tensor([t for t, _ in top])
            deviations.append(float((torch.tensor([v for _, v in top]) - ref[ids]).abs().max()))
        close += agrees_until_a_flip(got.token_ids, want, deviations, exact)
    return close


def scaled_kv_checkpoint(src: Path, out: Path, scales: list[tuple[float, float]] | None, v_gain: float = 1.0) -> Path:
    """`src` with V's projection times v_gain and o_proj over it (the same model), and `scales` as
    compressed-tensors names them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in list(tensors):
        if ".v_proj." in name:
            tensors[name] = tensors[name] * v_gain
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] / v_gain
    for i, (k, v) in enumerate(scales or []):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
