"""4-bit weight-only (W4A16) linears with group-wise scales and zero points, as AWQ and GPTQ write them.

A quantized linear holds `weight` uint8 [out, in / 2] (two 4-bit values q a byte: input column 2j
in the low nibble, 2j + 1 in the high one) and `weight_scale` float16 [out, in / group, 2], the
(scale s, zero point z) of each group of `group` input columns, with

    weight[n, k] = (q[n, k] - z[n, k // group]) * s[n, k // group]

exact in float32 (s a float16, z an integer in [0, 15]). Activations stay in the model's dtype.
Two paths: `cuda` with Triton (int4_kernels.words_matmul, on tensor cores, up to WORDS_MAX_ROWS
rows, past them dequantize_words and cuBLAS, for every projection whose shape `words_block_n`
takes; the weights then held in `to_words`' layout, convert.py's `set_int4_words` says when) and
`reference` (dequantize to the activations' dtype, then multiply; any device, and CUDA projections
of other shapes). Knows nothing of checkpoints (checkpoint.py) or modules (convert.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

Int4Path = Literal["cuda", "reference"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ packs output columns 8 to an int32 in this order: nibble i holds column 8c + AWQ_ORDER[i]."""


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [rows, cols] of values in [0, 15] (cols even) -> uint8 [rows, cols / 2], column 2j low."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse -> uint8 [rows, 2 * cols]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """An AWQ int32 tensor [rows, cols / 8] -> the 4-bit values [rows, cols] in column order."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [rows, cols / 8, 8]: nibble i
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles  # nibble i is column AWQ_ORDER[i] of its 8
    return columns.reshape(packed.shape[0], -1)


def unpack_gptq_rows(packed: torch.Tensor) -> torch.Tensor:
    """A GPTQ int32 tensor [rows / 8, cols] (row 8i + j in bits 4j of row i) -> values [rows, cols]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF  # [rows / 8, 8, cols]
    return nibbles.reshape(-1, packed.shape[1])


def unpack_gptq_columns(packed: torch.Tensor) -> torch.Tensor:
    """A GPTQ int32 tensor [rows, cols / 8] (column 8c + j in bits 4j) -> values [rows, cols]."""
    return unpack_gptq_rows(packed.t()).t()


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight uint8 [out, in / 2], weight_scale [out, groups, 2] -> [out, in] in `dtype`."""
    q = unpack_nibbles(weight).float()  # [out, in]
    out, cols = q.shape
    group = cols // weight_scale.shape[1]
    s, z = weight_scale.float().unbind(-1)  # [out, groups] each
    w = (q.view(out, -1, group) - z[:, :, None]) * s[:, :, None]
    return w.view(out, cols).to(dtype)


def words_block_n(weight: torch.Tensor, weight_scale: torch.Tensor) -> int | None:
    """The rows a tile of `to_words`' layout for this projection (128, else 64, 32 or 16: what divides its
    rows), or None when the layout does not take it: K a multiple of 128 (a trip of the kernel), and
    groups of 16, 32, 64 or a multiple of 128 columns (a group within one 16-column product)."""
    return _block_n(weight.shape[0], weight.shape[1] * 2, weight_scale.shape[1])


@functools.lru_cache(maxsize=256)
def _block_n(n: int, k: int, groups: int) -> int | None:
    """words_block_n by shape, once a shape (Int4Matmul asks at every product of every step)."""
    group = k // groups
    if k % 128 or group % 16 or (128 % group and group % 128):
        return None
    # NOTE: 128 rows since the scales are read as words (bench/results/int4_gemv_sweep_scale_pair_word_*: at one row
    # o 6.5 against 7.1 us at 64 rows a tile, gate_up 23.3 against 26.3, down 13.6 against 15.8, qkv 8.6 against 8.4)
    return next((b for b in (128, 64, 32, 16) if n % b == 0), None)


def to_words(weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_nibbles' bytes [N, K / 2] and scales [N, groups, 2] -> the same shapes and bytes in the
    kernel's layout: int32 words [N / block_n, K / 128, block_n, 16] (nibble i of word w is column
    16 i + w of its 128) and scales [N / block_n, groups, block_n, 2]: a tile's trip contiguous."""
    if weight_scale.dtype != torch.float16:
        # NOTE: the words kernel reads a row's (scale, zero point) as one 32-bit word (int4_kernels._group_scales)
        raise ValueError(f"int4 weight_scale must be float16 (scale, zero point) pairs, got {weight_scale.dtype}")
    n, half = weight.shape
    groups = weight_scale.shape[1]
    q = unpack_nibbles(weight).to(torch.int32).view(n // block_n, block_n, half // 64, 8, 16).transpose(1, 2)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight.device).view(8, 1)
    words = (q << shifts).sum(3, dtype=torch.int32)  # [tiles, trips, block_n, 16]: disjoint bits, so + is |
    scale = weight_scale.view(n // block_n, block_n, groups, 2).transpose(1, 2)
    return words.contiguous().view(torch.uint8).view(n, half), scale.contiguous().view(n, groups, 2)


def from_words(weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """to_words' inverse."""
    n, half = weight.shape
    groups = weight_scale.shape[1]
    words = weight.view(torch.int32).view(n // block_n, half // 64, block_n, 1, 16)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight.device).view(8, 1)
    q = (words >> shifts) & 0xF  # [tiles, trips, block_n, 8, 16]
    q = q.transpose(1, 2).reshape(n, 2 * half)
    scale = weight_scale.view(n // block_n, groups, block_n, 2).transpose(1, 2)
    return pack_nibbles(q), scale.contiguous().view(n, groups, 2)


def int4_path(device: torch.device, dtype: torch.dtype) -> Int4Path:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return "cuda"
    return "reference"


class Int4Matmul:
    """y = x @ W.T for 4-bit weights on one path; `triton` on the cuda path: `words` is set, and each
    projection `words_block_n` takes is in to_words' layout and multiplies in int4_kernels (up to
    WORDS_MAX_ROWS rows; more are multiplied by cuBLAS, the weight dequantized by a kernel first)."""

    def __init__(self, path: Int4Path, triton: bool) -> None:
        self.path = path
        self.words = triton and path == "cuda"
        self._words_matmul = None
        self._words_max_rows = 0
        # NOTE: one count buffer a device for all of a model's products: they run one after another
        # on its stream, and each leaves the counts zeroed (as fp8.Fp8Matmul's).
        self._counts: dict[torch.device, torch.Tensor] = {}
        if self.words:
            from engine.quant import int4_kernels  # NOTE: imports triton; only CUDA models (and interpreted tests) do

            self._words_matmul, self._split_k_counts = int4_kernels.words_matmul, int4_kernels.split_k_counts
            self._words_max_rows, self._dequantize_words = int4_kernels.WORDS_MAX_ROWS, int4_kernels.dequantize_words

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        block_n = words_block_n(weight, weight_scale) if self._words_matmul is not None else None
        if block_n is not None and rows.shape[0] > self._words_max_rows:
            out = torch.nn.functional.linear(rows, self._dequantize_words(weight, weight_scale, x.dtype, block_n), bias)
        elif block_n is not None:
            if x.device not in self._counts:
                self._counts[x.device] = self._split_k_counts(x.device)
            out = self._words_matmul(rows, weight, weight_scale, bias, block_n, self._counts[x.device])
        else:
            out = torch.nn.functional.linear(rows, dequantize(weight, weight_scale, x.dtype), bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
