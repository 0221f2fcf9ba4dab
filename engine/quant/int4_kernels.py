"""The Triton kernel behind `int4.Int4Matmul` for a few rows: 4-bit weights unpacked, shifted by
their zero points and scaled in registers (exact in float32, as int4.dequantize), products with the
activations summed in float32; imported only by CUDA models and interpreted tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.pdl import PDL_PRODUCT_MAX_ROWS, after_previous, pdl_options


# NOTE: M (the step's rows) is not specialized: one variant per BLOCK_M serves every batch size,
# none is compiled mid-serving (see engine/attention/triton_kernels.py's _decode_kernel).
@triton.jit(do_not_specialize=["M"])
def _small_matmul_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:, n-block] for all M (<= BLOCK_M) rows on CUDA cores; BLOCK_K a multiple of GROUP, K of
    BLOCK_K. The weight is read as int32 words (w_ptr: the uint8 weight viewed as int32, stride_w in
    words); nibble i of word c is column 8c + i. Few instructions a weight and row, as the product
    (not the read) bounds this kernel (bench/diag/int4_gemv_sweep.py):
    - a nibble becomes a float by its bits, no conversion: masked into mantissa bits 19-22 under
      the exponent of 1.0 it reads 1 + q/16, into bits 15-18 under that of 16.0 it reads 16 + q/16
      (exact), so one AND-OR (LOP3) a nibble and one shift for every two (by 3 and 11 left, 5
      right, and a rotation by 19 for nibbles 0 and 7);
    - one FMA a nibble and row sums x * f over a word, d = sum_i x_i f_i - A with the offsets'
      part A = sum_i a_i x_i (a_i in {1, 16}) taken out first, so d = (sum_i x_i q_i) / 16;
    - the group's zero point and scale apply a word, not a weight: s (sum x q - z sum x) is
      (16 s) d - (s z) X with X = sum_i x_i, two FMAs a word and row.
    Compiled for sm_90 at one row, its loop issues 4.3 instructions a weight (the kernel before it,
    which subtracted the zero point and scaled each weight: 6.4). Sums in float32: d's terms are at
    most 17 |x| against a 1/16 step, so the result keeps about 20 bits of sum_k |x_k| 8 s_k."""
    pid = tl.program_id(0)
    WPG: tl.constexpr = GROUP // 8  # words a group
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rm = tl.arange(0, BLOCK_M)[:, None, None, None]
    n4 = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None, None]
    g4 = tl.arange(0, GROUPS)[None, None, :, None]
    word = g4 * WPG + tl.arange(0, WPG)[None, None, None, :]  # [1, 1, GROUPS, WPG]: a tile's words
    m_ok, n_ok = rm < M, n4 < N
    acc = tl.zeros([BLOCK_M, BLOCK_N, GROUPS, WPG], dtype=tl.float32)
    after_previous(PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptr + n4 * stride_w + (k0 // 8 + word), mask=n_ok, other=0)  # [1, BN, GROUPS, WPG]
        s_row = s_ptr + n4 * stride_sn + (k0 // GROUP + g4) * 2
        s = tl.load(s_row, mask=n_ok, other=0.0).to(tl.float32)  # [1, BN, GROUPS, 1]
        z = tl.load(s_row + 1, mask=n_ok, other=0.0).to(tl.float32)
        xp = x_ptr + rm * stride_x + (k0 + 8 * word)  # [BM, 1, GROUPS, WPG]: column 8 * word + i at + i
        x0 = tl.load(xp + 0, mask=m_ok, other=0.0).to(tl.float32)
        x1 = tl.load(xp + 1, mask=m_ok, other=0.0).to(tl.float32)
        x2 = tl.load(xp + 2, mask=m_ok, other=0.0).to(tl.float32)
        x3 = tl.load(xp + 3, mask=m_ok, other=0.0).to(tl.float32)
        x4 = tl.load(xp + 4, mask=m_ok, other=0.0).to(tl.float32)
        x5 = tl.load(xp + 5, mask=m_ok, other=0.0).to(tl.float32)
        x6 = tl.load(xp + 6, mask=m_ok, other=0.0).to(tl.float32)
        x7 = tl.load(xp + 7, mask=m_ok, other=0.0).to(tl.float32)
        at_16 = x1 + x3 + x5 + x7  # the nibbles read as 16 + q/16
        at_1 = x0 + x2 + x4 + x6  # those read as 1 + q/16
        unsigned = w.to(tl.uint32, bitcast=True)
        turned = ((unsigned << 19) | (unsigned >> 13)).to(tl.int32, bitcast=True)  # nibbles 7, 0 at 15, 19
        up3 = w << 3  # nibbles 3, 4 at bits 15, 19
        up11 = w << 11  # 1, 2
        down5 = w >> 5  # 5, 6
        d = -(16.0 * at_16 + at_1)
        d += x0 * ((turned & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        d += x1 * ((up11 & 0x78000) | 0x41800000).to(tl.float32, bitcast=True)
        d += x2 * ((up11 & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        d += x3 * ((up3 & 0x78000) | 0x41800000).to(tl.float32, bitcast=True)
        d += x4 * ((up3 & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        d += x5 * ((down5 & 0x78000) | 0x41800000).to(tl.float32, bitcast=True)
        d += x6 * ((down5 & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        d += x7 * ((turned & 0x78000) | 0x41800000).to(tl.float32, bitcast=True)
        acc += (s * 16.0) * d - (s * z) * (at_16 + at_1)
    out = tl.sum(tl.sum(acc, axis=3), axis=2)  # [BM, BN]
    rm2 = tl.arange(0, BLOCK_M)[:, None]
    rn2 = pid * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn2, mask=rn2 < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm2 * stride_o + rn2, out.to(out_ptr.dtype.element_ty), mask=(rm2 < M) & (rn2 < N))


SMALL_MATMUL_MAX_ROWS = 2
"""The most rows Int4Matmul sends to `small_matmul` (more: the tensor-core tiles of `matmul`)."""

SMALL_MATMUL_CONFIGS = {1: (16, 1024, 4, 3), 2: (16, 512, 4, 3)}
"""small_matmul's (block_n, block_k, num_warps, num_stages) by rows: the tiles of least summed time over
Llama-3.1-8B's four projections on an H200 (bench/results/int4_gemv_sweep_nvidia-h200_r5_words.json)."""


def small_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Int4Matmul for x [M, K] with few rows: one launch. config: (block_n, block_k, num_warps,
    num_stages); block_k a multiple of the group size that divides K. The defaults: see
    SMALL_MATMUL_CONFIGS."""
    m, k = x.shape
    n, groups = weight.shape[0], weight_scale.shape[1]
    group = k // groups
    if group % 8 or group & (group - 1):
        raise ValueError(f"small_matmul reads 8 columns a word: the group size must be a power of two of at least 8; "
                         f"got {group} ({k} columns in {groups} groups)")
    block_n, block_k, num_warps, num_stages = config or SMALL_MATMUL_CONFIGS[min(m, SMALL_MATMUL_MAX_ROWS)]
    block_k = max(block_k, group)
    while k % block_k or block_k % group:
        block_k //= 2
    words = weight.view(torch.int32)  # [N, K / 8]: bytes 4c..4c+3 little-endian, nibble i column 8c + i
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _small_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, words, weight_scale, bias if bias is not None else x, out, m, n, k, x.stride(0), words.stride(0),
        weight_scale.stride(0), out.stride(0), GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps, **pdl_options(x.device, m, max_rows=PDL_PRODUCT_MAX_ROWS))
    return out


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m-block, n-block] on tensor cores: each K tile of the weight dequantized in registers to
    the activations' dtype (rounded as int4.dequantize then a cast rounds it), float32 accumulation.
    BLOCK_K a multiple of GROUP that divides K."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    after_previous(PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None], other=0.0)
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rn[:, None] * stride_w + rb[None, :], mask=n_ok[:, None], other=0)
        q = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
        g = k0 // GROUP + tl.arange(0, GROUPS)
        s_row = s_ptr + rn[:, None] * stride_sn + g[None, :] * 2
        scale = tl.load(s_row, mask=n_ok[:, None], other=0.0).to(tl.float32)
        zero = tl.load(s_row + 1, mask=n_ok[:, None], other=0.0).to(tl.float32)
        w = ((q.reshape(BLOCK_N, GROUPS, GROUP) - zero[:, :, None]) * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Int4Matmul for x [M, K], any M: one launch of tensor-core tiles. config: (block_m, block_n,
    block_k, num_warps, num_stages); by default block_m from M (16..64), 128 x 128 otherwise."""
    m, k = x.shape
    n, groups = weight.shape[0], weight_scale.shape[1]
    group = k // groups
    block_m, block_n, block_k, num_warps, num_stages = config or (min(64, max(16, triton.next_power_of_2(m))),
                                                                  128, 128, 4, 3)
    block_k = max(block_k, group)
    while k % block_k or block_k % group:
        block_k //= 2
    if block_k < group:
        block_k = group
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **pdl_options(x.device, m, max_rows=0))
    return out
