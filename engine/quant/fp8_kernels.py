"""The Triton kernel behind `fp8.Fp8Matmul`'s activation quantization: one program a row, equal to
`fp8.quantize_rows` bit for bit; imported only by CUDA models and interpreted tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.fp8 import FP8, FP8_MAX, MIN_SCALE


@triton.jit
def round_e4m3(y):
    """float32 values within +-448 rounded to E4M3's grid (3 mantissa bits; spacing 2^-9 below 2^-6)
    to nearest even, sign kept, so that a conversion to E4M3 after it is exact on every backend
    (Triton's interpreter rounds some values wrongly): |y| + m - m with m = 1.5 * 2^(exponent + 20)
    leaves |y| rounded at float32's spacing around m, which is E4M3's spacing around |y|."""
    a = tl.abs(y)
    exponent = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)
    m = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + m) - m
    return (r.to(tl.uint32, bitcast=True) | (y.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n, fp8_max, min_scale,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / fp8_max, min_scale)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + cols, round_e4m3(y).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows for x [rows, n] with a contiguous last dimension."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), n, FP8_MAX, MIN_SCALE, BLOCK=block,
                                       num_warps=min(32, max(4, block // 512)))
    return q, scale


@triton.jit
def _small_matmul_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, fp8_max, min_scale,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """out[:, n-block] for all M (<= BLOCK_M) rows of x, on CUDA cores (no tensor-core tile to pad
    M into): each program quantizes x per row itself (fp8.quantize_rows' scales: a first pass over
    K for each row's max), multiplies the E4M3 values with its FP8 weight rows (products exact in
    float32), accumulates in float32, and applies both scales and the bias."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
    scale = tl.maximum(amax / fp8_max, min_scale)
    # NOTE: products summed elementwise across the K loop, reduced over BLOCK_K once at the end (a
    # cross-thread reduction every iteration costs more than the weights' bytes).
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -fp8_max), fp8_max)
        xq = round_e4m3(y)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += xq[:, None, :] * w.to(tl.float32)[None, :, :]
    w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    out = tl.sum(acc, axis=2) * scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


SMALL_MATMUL_MAX_ROWS = 2
"""The most rows Fp8Matmul sends to `small_matmul` rather than torch._scaled_mm: measured on an H100 at
the Llama-3.1-8B shapes (bench/results/fp8_small_sweep_*), its products on CUDA cores cost more per
weight byte with each row, and cuBLAS is ahead by 4 rows."""


def _small_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages): the sweep's best at one row on an H100, by shape
    (bench/results/fp8_small_sweep_*: Llama-3.1-8B's down, gate_up, qkv and o projections)."""
    if k > 8192:
        return 8, 1024, 4, 3
    if n > 16384:
        return 32, 256, 4, 4
    if n > 4096:
        return 16, 512, 4, 3
    return 16, 1024, 8, 3


def small_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Fp8Matmul for x [M, K] with few rows, quantization included: one launch. config: (block_n,
    block_k, num_warps, num_stages), by default _small_config's for the shape."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, num_warps, num_stages = config or _small_config(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _small_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), FP8_MAX, MIN_SCALE, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps)
    return out
