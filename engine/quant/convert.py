"""Gives a model's projections quantized storage before its weights load.

Each decoder layer's q/k/v, o, gate/up and down projections get a quantized `weight` and a buffer
`weight_scale`: FP8 (fp8.py: float8_e4m3fn [out, in] and float32 [out]) or 4-bit (int4.py: uint8
[out, in / 2] and float16 [out, in / group, 2]); the fused qkv and gate_up tensors
(`<name>_weight`, `<name>_weight_scale`) hold their parts as views, as in bfloat16. The embedding,
lm_head and norms stay in the model's dtype. A tensor-parallel rank's FP8 scales follow its weight
rows (column-parallel) or are whole (row-parallel: its columns share the rows' scales); its 4-bit
scales follow its rows, or its columns' whole groups. Loaders fill 4-bit projections in
pack_nibbles' layout; `set_int4_words` then moves those the CUDA kernel takes into its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.parallel import Shard
from engine.quant.fp8 import FP8, Fp8Path
from engine.quant.int4 import Int4Path, from_words, to_words, words_block_n

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}

Storage = Callable[[torch.Tensor], torch.Tensor]  # a bfloat16 weight [out, in] -> its quantized twin, empty


def _row_scale_shard(weight: nn.Parameter) -> Shard | None:
    shard: Shard | None = getattr(weight, "shard", None)
    return shard if shard is not None and shard.dim == 0 else None


def _set_scale(linear: nn.Module, scale: torch.Tensor, shard: Shard | None) -> None:
    """`weight.quant_scale` is the same tensor: loaders that fill the weight fill its scale."""
    if shard is not None:
        scale.shard = shard  # type: ignore[attr-defined]
    linear.register_buffer("weight_scale", scale, persistent=False)
    linear.weight.quant_scale = scale


def _set_weight(linear: nn.Module, weight: torch.Tensor) -> None:
    shard = getattr(linear.weight, "shard", None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if shard is not None:
        linear.weight.shard = shard


def _convert(model: nn.Module, weight_of: Storage, scale_of: Storage) -> None:
    for layer in model.model.layers:  # type: ignore[union-attr]
        for owner in (layer.self_attn, layer.mlp):
            for fused, parts in _FUSED.items():
                if not hasattr(owner, f"{fused}_weight"):
                    continue
                whole = getattr(owner, f"{fused}_weight")
                weight, scale = weight_of(whole), scale_of(whole)
                owner.register_buffer(f"{fused}_weight", weight, persistent=False)
                owner.register_buffer(f"{fused}_weight_scale", scale, persistent=False)
                start = 0
                for part in parts:
                    linear = getattr(owner, part)
                    rows = linear.weight.shape[0]
                    _set_weight(linear, weight[start : start + rows])
                    _set_scale(linear, scale[start : start + rows], _row_scale_shard(linear.weight))
                    start += rows
            for name in ("o_proj", "down_proj"):
                linear = getattr(owner, name, None)
                if linear is None:
                    continue
                scale = scale_of(linear.weight)
                _set_weight(linear, weight_of(linear.weight))
                _set_scale(linear, scale, _row_scale_shard(linear.weight))


def convert_to_fp8(model: nn.Module, path: Fp8Path) -> None:
    """Every decoder layer's projections FP8 (uninitialized: loaders fill weight and weight_scale),
    multiplied on `path` (model.fp8_path)."""
    model.fp8_path = path
    _convert(model, lambda w: torch.empty(w.shape, dtype=FP8, device=w.device),
             lambda w: torch.ones(w.shape[0], dtype=torch.float32, device=w.device))


def convert_to_int4(model: nn.Module, group_size: int, path: Int4Path) -> None:
    """Every decoder layer's projections 4-bit with `group_size` input columns a scale (uninitialized),
    multiplied on `path` (model.int4_path)."""

    def scales(w: torch.Tensor) -> torch.Tensor:
        if w.shape[1] % group_size:
            raise ValueError(f"4-bit groups of {group_size} columns do not divide a projection's {w.shape[1]} input "
                             "columns this rank holds; with tensor parallelism, use a size whose share is a multiple "
                             "of the group size")
        return torch.empty(w.shape[0], w.shape[1] // group_size, 2, dtype=torch.float16, device=w.device)

    model.int4_path = path
    _convert(model, lambda w: torch.empty(w.shape[0], w.shape[1] // 2, dtype=torch.uint8, device=w.device), scales)


WORDS_CHUNK_ROWS = 4096
"""Rows `set_int4_words` moves at a time (to_words' temporaries are 8 bytes a weight, so an 8B gate/up at
once would take 0.9 GB more)."""


def _int4_products(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, weight_scale) of every 4-bit product the forward multiplies: the fused wholes, o and down."""
    products = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        for owner in (layer.self_attn, layer.mlp):
            for fused in _FUSED:
                if getattr(owner, f"{fused}_weight_scale", None) is not None:
                    products.append((getattr(owner, f"{fused}_weight"), getattr(owner, f"{fused}_weight_scale")))
            for name in ("o_proj", "down_proj"):
                linear = getattr(owner, name, None)
                if linear is not None and linear.weight_scale is not None:
                    products.append((linear.weight, linear.weight_scale))
    return [(w, s) for w, s in products if w.dtype == torch.uint8]


@torch.no_grad()
def set_int4_words(model: nn.Module, words: bool) -> None:
    """Holds every 4-bit product `words_block_n` takes in int4.to_words' layout (words) or in
    pack_nibbles' (not), in place, `WORDS_CHUNK_ROWS` rows at a time; model.int4_words records which.
    The fused parts' views (q/k/v, gate/up) then hold their rows' tiles only where a part's rows are
    whole tiles; nothing reads them after loading."""
    if getattr(model, "int4_words", False) == words:
        return
    move = to_words if words else from_words
    for weight, scale in _int4_products(model):
        block_n = words_block_n(weight, scale)
        if block_n is None:
            continue
        for start in range(0, weight.shape[0], WORDS_CHUNK_ROWS):
            rows = slice(start, min(start + WORDS_CHUNK_ROWS, weight.shape[0]))
            w, s = move(weight[rows], scale[rows], block_n)
            weight[rows] = w
            scale[rows] = s
    model.int4_words = words
