"""The Triton kernel behind `fp8.Fp8Matmul`'s activation quantization: one program a row, equal to
`fp8.quantize_rows` bit for bit; imported only by CUDA models and interpreted tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.fp8 import FP8, FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n, fp8_max, min_scale,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / fp8_max, min_scale)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    # Round to E4M3's grid (3 mantissa bits; spacing 2^-9 below 2^-6) to nearest even here, so the
    # conversion below is exact on every backend: |y| + m - m with m = 1.5 * 2^(exponent + 20)
    # leaves |y| rounded at float32's spacing around m, which is E4M3's spacing around |y|.
    a = tl.abs(y)
    exponent = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # 121: the exponent field of 2^-6
    m = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + m) - m
    r = tl.where(y < 0, -r, r)
    tl.store(q_ptr + row * stride_q + cols, r.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows for x [rows, n] with a contiguous last dimension."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n, FP8_MAX, MIN_SCALE,
                                       BLOCK=triton.next_power_of_2(n))
    return q, scale
