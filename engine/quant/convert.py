"""Gives a model's projections FP8 storage before its weights load.

Each decoder layer's q/k/v, o, gate/up and down projections get `weight` float8_e4m3fn [out, in]
and a buffer `weight_scale` float32 [out] (fp8.py says what they mean); the fused qkv and gate_up
tensors (`<name>_weight`, `<name>_weight_scale`) hold their parts as views, as in bfloat16. The
embedding, lm_head and norms stay in the model's dtype. A tensor-parallel rank's scales follow its
weight rows (column-parallel) or are whole (row-parallel: its columns share the rows' scales).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel import Shard
from engine.quant.fp8 import FP8, Fp8Path

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _fp8_weight(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(weight.shape, dtype=FP8, device=weight.device), requires_grad=False)


def _row_scale_shard(weight: nn.Parameter) -> Shard | None:
    shard: Shard | None = getattr(weight, "shard", None)
    return shard if shard is not None and shard.dim == 0 else None


def _set_scale(linear: nn.Module, scale: torch.Tensor, shard: Shard | None) -> None:
    """`weight.fp8_scale` is the same tensor: loaders that fill the weight fill its scale."""
    if shard is not None:
        scale.shard = shard  # type: ignore[attr-defined]
    linear.register_buffer("weight_scale", scale, persistent=False)
    linear.weight.fp8_scale = scale


def convert_to_fp8(model: nn.Module, path: Fp8Path) -> None:
    """Every decoder layer's projections FP8 (uninitialized: loaders fill weight and weight_scale),
    multiplied on `path` (model.fp8_path)."""
    model.fp8_path = path
    for layer in model.model.layers:  # type: ignore[union-attr]
        for owner in (layer.self_attn, layer.mlp):
            for fused, parts in _FUSED.items():
                if not hasattr(owner, f"{fused}_weight"):
                    continue
                whole = getattr(owner, f"{fused}_weight")
                weight = torch.empty(whole.shape, dtype=FP8, device=whole.device)
                scale = torch.ones(whole.shape[0], dtype=torch.float32, device=whole.device)
                owner.register_buffer(f"{fused}_weight", weight, persistent=False)
                owner.register_buffer(f"{fused}_weight_scale", scale, persistent=False)
                start = 0
                for part in parts:
                    linear = getattr(owner, part)
                    rows = linear.weight.shape[0]
                    shard = getattr(linear.weight, "shard", None)
                    linear.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
                    if shard is not None:
                        linear.weight.shard = shard
                    _set_scale(linear, scale[start : start + rows], _row_scale_shard(linear.weight))
                    start += rows
            for name in ("o_proj", "down_proj"):
                linear = getattr(owner, name, None)
                if linear is None:
                    continue
                shard = getattr(linear.weight, "shard", None)
                linear.weight = _fp8_weight(linear.weight)
                if shard is not None:
                    linear.weight.shard = shard
                _set_scale(linear, torch.ones(linear.weight.shape[0], dtype=torch.float32, device=linear.weight.device),
                           _row_scale_shard(linear.weight))
