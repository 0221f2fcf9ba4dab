"""The Triton kernel behind `int4.Int4Matmul` for a few rows: 4-bit weights unpacked, shifted by
their zero points and scaled in registers (exact in float32, as int4.dequantize), products with the
activations summed in float32; imported only by CUDA models and interpreted tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# NOTE: M (the step's rows) is not specialized: one variant per BLOCK_M serves every batch size,
# none is compiled mid-serving (see engine/attention/triton_kernels.py's _decode_kernel).
@triton.jit(do_not_specialize=["M"])
def _small_matmul_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """out[:, n-block] for all M (<= BLOCK_M) rows; BLOCK_K a multiple of GROUP, K of BLOCK_K:
    CUDA-core products, summed elementwise over the K loop. A nibble q becomes a float by its bits
    (q | 0x4B000000 is the float 2^23 + q, exact) and one subtraction of 2^23 + z gives q - z: no
    int-to-float conversion, a quarter-rate instruction on Hopper's CUDA cores, which bound this
    kernel (bench/diag/int4_gemv_sweep.py: its tiles read alone took 1.1-2.1x the floor)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    j = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N, HALF], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        packed = tl.load(w_ptr + rn[:, None] * stride_w + (k0 // 2 + j)[None, :], mask=n_ok[:, None], other=0)
        packed = packed.to(tl.int32)  # [BN, HALF]: byte j holds columns k0 + 2j (low) and k0 + 2j + 1
        g = k0 // GROUP + tl.arange(0, GROUPS)
        s_row = s_ptr + rn[:, None] * stride_sn + g[None, :] * 2
        scale = tl.load(s_row, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]  # [BN, GROUPS, 1]
        zero = tl.load(s_row + 1, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None] + 8388608.0
        lo = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True).reshape(BLOCK_N, GROUPS, GROUP // 2)
        hi = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True).reshape(BLOCK_N, GROUPS, GROUP // 2)
        w_lo = ((lo - zero) * scale).reshape(BLOCK_N, HALF)
        w_hi = ((hi - zero) * scale).reshape(BLOCK_N, HALF)
        x_row = x_ptr + rm[:, None] * stride_x + (k0 + 2 * j)[None, :]
        x_even = tl.load(x_row, mask=m_ok[:, None], other=0.0).to(tl.float32)  # [BM, HALF]
        x_odd = tl.load(x_row + 1, mask=m_ok[:, None], other=0.0).to(tl.float32)
        acc += w_lo[None, :, :] * x_even[:, None, :] + w_hi[None, :, :] * x_odd[:, None, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


SMALL_MATMUL_MAX_ROWS = 2
"""The most rows Int4Matmul sends to `small_matmul` (more: dequantize, then one matmul)."""


def small_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Int4Matmul for x [M, K] with few rows: one launch. config: (block_n, block_k, num_warps,
    num_stages); block_k a multiple of the group size that divides K. The defaults are the fastest
    of bench/diag/int4_gemv_sweep.py's tiles at the Llama-3.1-8B shape on an H200 (one row: 16 x 1,024
    at qkv 16 x 512 within 3%; two rows: 16 x 256)."""
    m, k = x.shape
    n, groups = weight.shape[0], weight_scale.shape[1]
    group = k // groups
    block_n, block_k, num_warps, num_stages = config or (16, max(group, 1024 if m == 1 else 256), 4, 3)
    while k % block_k:
        block_k //= 2
    block_k = max(block_k, group)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _small_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps)
    return out


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PRECISION: tl.constexpr,
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
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return out
