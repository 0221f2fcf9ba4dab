"""4-bit weight-only (W4A16) linears with group-wise scales and zero points, as AWQ and GPTQ write them.

A quantized linear holds `weight` uint8 [out, in / 2] (two 4-bit values q a byte: input column 2j
in the low nibble, 2j + 1 in the high one) and `weight_scale` float16 [out, in / group, 2], the
(scale s, zero point z) of each group of `group` input columns, with

    weight[n, k] = (q[n, k] - z[n, k // group]) * s[n, k // group]

exact in float32 (s a float16, z an integer in [0, 15]). Activations stay in the model's dtype.
Two paths: `cuda` (int4_kernels: up to SMALL_MATMUL_MAX_ROWS rows a CUDA-core kernel, more rows
tensor-core tiles with the weight dequantized to the activations' dtype in registers) and
`reference` (dequantize to the activations' dtype, then multiply; any device). Knows nothing of
checkpoints (checkpoint.py) or modules (convert.py).
"""

from __future__ import annotations

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


def int4_path(device: torch.device, dtype: torch.dtype) -> Int4Path:
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return "cuda"
    return "reference"


class Int4Matmul:
    """y = x @ W.T for 4-bit weights on one path; `triton`: the Triton kernel (CUDA) where it serves."""

    def __init__(self, path: Int4Path, triton: bool) -> None:
        self.path = path
        self._small = self._tiles = None
        self._small_max_rows = 0
        if triton and path == "cuda":
            from engine.quant import int4_kernels  # NOTE: imports triton; only CUDA models (and interpreted tests) do

            self._small, self._small_max_rows = int4_kernels.small_matmul, int4_kernels.SMALL_MATMUL_MAX_ROWS
            self._tiles = int4_kernels.matmul

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self._small_max_rows:
            out = self._small(rows, weight, weight_scale, bias)
        elif self._tiles is not None:
            out = self._tiles(rows, weight, weight_scale, bias)
        else:
            out = torch.nn.functional.linear(rows, dequantize(weight, weight_scale, x.dtype), bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
