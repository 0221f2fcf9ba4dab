"""The Triton kernels behind `fp8.Fp8Matmul`: the activation quantization (equal to
`fp8.quantize_rows` bit for bit; a few long rows spread in chunks over SMs), the product of one
quantized row on the CUDA cores (`gemv_matmul`), and a split-K tensor-core product of quantized rows
for other small batches; imported only by CUDA models and interpreted tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.models.row_kernels import row_dot
from engine.pdl import PDL_PRODUCT_MAX_ROWS, after_previous, pdl_options
from engine.quant.fp8 import FP8, FP8_MAX, MIN_SCALE
from engine.quant.split_k import store_split_k


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


# NOTE: constexpr: a Triton kernel reads no other global (its compiler refuses them; the interpreter does not)
E4M3_MAX = tl.constexpr(FP8_MAX)
SMALLEST_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def row_scale(amax):
    """fp8.quantize_rows' scale of a row whose largest magnitude is `amax` (float32)."""
    return tl.maximum(amax / E4M3_MAX, SMALLEST_SCALE)


@triton.jit
def to_e4m3(y, inverse):
    """float32 values y of a row times its scale's reciprocal (`inverse`, tl.math.div_rn(1, scale)),
    saturated and rounded as fp8.quantize_rows does: still float32, exact in E4M3."""
    return round_e4m3(tl.minimum(tl.maximum(y * inverse, -E4M3_MAX), E4M3_MAX))


@triton.jit
def quantize_row(y, ok):
    """A whole row y (float32, `ok` its columns) quantized as fp8.quantize_rows does: (values, still
    float32 and exact in E4M3, and the row's scale)."""
    scale = row_scale(tl.max(tl.where(ok, tl.abs(y), 0.0), 0))
    return to_e4m3(y, tl.math.div_rn(1.0, scale)), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n, chunk,
                          ROW_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row axis 1, its columns [chunk * axis 0, + chunk) (chunk a multiple of BLOCK): each program
    reads its whole row for the row's max, ROW_BLOCK columns a load (all in flight at once: a loop
    of small loads waits for each), then quantizes its chunk; the first chunk writes the scale.
    Chunks spread a few long rows over many SMs."""
    after_previous(PDL)
    row = tl.program_id(1).to(tl.int64)
    begin = tl.program_id(0) * chunk
    wide = tl.arange(0, ROW_BLOCK)
    amax = tl.zeros([ROW_BLOCK], dtype=tl.float32)
    for k0 in range(0, n, ROW_BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + wide, mask=k0 + wide < n, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0))
    inverse = tl.math.div_rn(1.0, scale)
    cols = tl.arange(0, BLOCK)
    for k0 in range(begin, tl.minimum(begin + chunk, n), BLOCK):
        ok = k0 + cols < n
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + cols, to_e4m3(x, inverse).to(q_ptr.dtype.element_ty), mask=ok)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + row, scale)


QUANTIZE_PROGRAMS = 256
"""Programs `quantize_rows` aims for: rows times chunks (at least one chunk a row, at most one per
1024 columns); each chunk rereads its row, so chunks are for few rows only."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows for x [rows, n] with a contiguous last dimension."""
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        chunks = max(1, min(QUANTIZE_PROGRAMS // rows, triton.cdiv(n, block)))
        chunk = triton.cdiv(triton.cdiv(n, chunks), block) * block
        _quantize_rows_kernel[(triton.cdiv(n, chunk), rows)](
            x, q, scale, x.stride(0), q.stride(0), n, chunk, ROW_BLOCK=min(16384, triton.next_power_of_2(n)),
            BLOCK=block, num_warps=8, **pdl_options(x.device, rows))
    return q, scale


# NOTE: M (the step's rows) is not specialized: one variant serves every batch size, none is
# compiled mid-serving (see engine/attention/triton_kernels.py's _decode_kernel).
@triton.jit(do_not_specialize=["M"])
def _split_k_matmul_kernel(
    xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
    stride_x, stride_w, stride_o, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m-block, n-block] of quantized rows on tensor cores (E4M3 x E4M3 -> float32), over one
    k_per_split slice of K (a multiple of BLOCK_K) per program along axis 2, the scales applied to
    each slice's sums; the slices summed by split_k.store_split_k."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    k_begin = pid_k * k_per_split
    after_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(xq_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    x_scale = tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    # slice s of the sums at part_ptr + s * M * N; a count a tile
    store_split_k(acc, out_ptr + rm[:, None] * stride_o + rn[None, :], part_ptr + rm[:, None] * N + rn[None, :],
                  m_ok[:, None] & n_ok[None, :], pid_k, count_ptr + pid_m * tl.num_programs(1) + pid_n, M, N, bias_ptr,
                  rn, n_ok, HAS_BIAS, SPLIT_K)


@triton.jit
def _gemv_kernel(
    xq_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[0, n-block] of one quantized row on the CUDA cores: E4M3 products, exact in float32, summed
    in float32 lane by lane over K, then across the tile's columns; the scales and bias after."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    total = row_dot(xq_ptr, w_ptr, rn, n_ok, K, stride_w, BLOCK_N, BLOCK_K, NUM_STAGES, PDL)  # waits in row_dot
    total = total * tl.load(x_scale_ptr) * tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)


GemvConfig = tuple[int, int, int, int]
"""(block_n, block_k, num_warps, num_stages) of `gemv_matmul`."""


def gemv_config(n: int) -> GemvConfig:
    """The sweep's rule (bench/results/fp8_gemv_sweep_nvidia-h200.json, one row, Llama-3.1-8B's projections):
    8 weight rows a program, K in steps of 1024 up to 512 programs (N <= 4096: o and down), of 512
    past them (qkv, gate_up); K unsplit (split in two at 512-column steps: +26 / +9 / +22 / -2 %). On
    that H200 it took 8.7 / 6.4 / 31.5 / 17.0 us against split_k_matmul's 9.6 / 7.7 / 34.8 / 20.9
    (qkv / o / gate_up / down; floors 6.2 / 4.2 / 29.1 / 14.5)."""
    return 8, 1024 if n <= 4096 else 512, 4, 3


def gemv_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemvConfig | None = None) -> torch.Tensor:
    """split_k_matmul's product for one quantized row xq [1, K], on the CUDA cores (float32 products
    and sums); config: gemv_config's by default."""
    m, k = xq.shape
    n = weight.shape[0]
    if m != 1:
        raise ValueError(f"gemv_matmul multiplies one row; got {m} (split_k_matmul takes more)")
    block_n, block_k, num_warps, num_stages = config or gemv_config(n)
    out = torch.empty(1, n, dtype=out_dtype, device=xq.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, num_warps=num_warps,
        **pdl_options(xq.device, 1, max_rows=PDL_PRODUCT_MAX_ROWS))
    return out


SplitKConfig = tuple[int, int, int, int, int, int]
"""(block_m, block_n, block_k, split_k, num_warps, num_stages) of `split_k_matmul`."""

SPLIT_K_MAX_ROWS = 32
"""The most rows Fp8Matmul sends to `split_k_matmul` rather than torch._scaled_mm: on an H200 at the
Llama-3.1-8B and 70B projection shapes (bench/results/fp8_split_k_sweep_*) the split-K product of up
to 32 rows reads the weights at 1.05-2.1x their floor where cuBLAS takes 1.4-3.4x; at 64 rows its
two 32-row tiles were behind cuBLAS on most shapes (a 64-row tile takes wgmma: split_k_config)."""

SPLIT_K_TILE_ROWS = 4096
"""Programs times tile rows split_k_config aims for: 256 programs of 16-row tiles, 128 of 32 (the
sweep's best splits at every shape; fewer programs leave bandwidth unused: the 8B o and down
projections, 64 tiles, ran 1.4x slower unsplit at 16 rows, and more made its 32-row tiles slower)."""


def split_k_config(m: int, k: int, n: int) -> SplitKConfig:
    """The sweep's rule (bench/results/fp8_split_k_sweep_*; within 6% of the best configuration
    found at every shape up to 16 rows): 16 or 32 rows a tile (64 would take Hopper's wgmma,
    whose FP8 sums are not exact float32: 0.5% off at K=3000 on an H200), 64 weight rows a tile
    (128 from 17 rows), K tiles of 256 from K=8192 (else 128), and K split in powers of two until
    SPLIT_K_TILE_ROWS / block_m programs or slices of 4 K tiles."""
    block_m = 16 if m <= 16 else 32
    block_n = 64 if m <= 16 else 128
    block_k = 256 if k >= 8192 else 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split * block_m < SPLIT_K_TILE_ROWS and k // (2 * split) >= 4 * block_k:
        split *= 2
    return block_m, block_n, block_k, split, 4, 4


MAX_TILES = 1 << 14
"""Output tiles of one `split_k_matmul` a count buffer of `split_k_counts` serves (32 rows of a
262,144-wide product at 128 columns a tile; Llama-3.1-70B's widest, gate/up, is 57,344)."""


def split_k_counts(device: torch.device) -> torch.Tensor:
    """A zeroed count per output tile for `split_k_matmul`'s slices; each launch leaves it zeroed."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def split_k_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, counts: torch.Tensor | None = None,
                   config: SplitKConfig | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale).T (+ bias) for quantized rows xq [M, K] (E4M3) with
    x_scale [M, 1] float32, weight [N, K] E4M3 and weight_scale [N] float32; float32 sums. counts:
    `split_k_counts`' buffer (a caller keeps one a device and stream; without it, one is made here).
    config: split_k_config's for the shape by default."""
    block_m, block_n, block_k, split_k, num_warps, num_stages = config or split_k_config(*xq.shape, weight.shape[0])
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    if grid[0] * grid[1] > MAX_TILES:
        raise ValueError(f"split_k_matmul of {m} x {n} takes {grid[0] * grid[1]} tiles; at most {MAX_TILES}")
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=xq.device) if split_k > 1 else out
    counts = counts if counts is not None else split_k_counts(xq.device)
    bias_arg = bias if bias is not None else weight_scale
    _split_k_matmul_kernel[grid](
        xq, x_scale, weight, weight_scale, bias_arg, out, part, counts, m, n, k, k_per_split, xq.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, num_warps=num_warps,
        **pdl_options(xq.device, m, max_rows=PDL_PRODUCT_MAX_ROWS))
    return out
