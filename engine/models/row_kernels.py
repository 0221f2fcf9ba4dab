"""One row times a 16-bit weight on the CUDA cores (`row_product`): a decode step's projections and LM head at
batch 1, where cuBLAS's small-M tiles and split-K reductions read the weights above their bandwidth floor
(README, tensor parallelism: the step and each product against cuBLAS). Products and sums in float32,
lane by lane over K, then across a tile's columns: the reference's sums in another order. `row_dot` is the
FP8 one-row product's sum too. Imported only by CUDA models and interpreted tests (it imports triton)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.pdl import PDL_PRODUCT_MAX_ROWS, after_previous, pdl_options

RowConfig = tuple[int, int, int, int]
"""(block_n, block_k, num_warps, num_stages) of `row_product`."""

ROW_CONFIG: RowConfig = (8, 512, 4, 3)  # the FP8 one-row product's tile at twice the bytes a weight (16 rows lost)
LONG_ROW_CONFIG: RowConfig = (8, 1024, 4, 3)  # rows of LONG_ROW_K or more (the 70B shape's projections)
LONG_ROW_K = 8192


def row_config(k: int) -> RowConfig:
    """The tile `row_product` multiplies rows of K with."""
    return LONG_ROW_CONFIG if k >= LONG_ROW_K else ROW_CONFIG


@triton.jit
def row_dot(x_ptr, w_ptr, rn, n_ok, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """w[rn] . x for one row x over K: float32 products summed lane by lane over K, then across each weight
    row's lanes (x and w of any dtype float32 holds exactly: 16-bit, or E4M3 for the FP8 one-row product).
    It waits for the kernel before it (`after_previous`) itself: the first tile of weights is loaded before
    the wait (a weight: no kernel writes it), so its read overlaps that kernel's end; x after it."""
    rk = tl.arange(0, BLOCK_K)
    k_ok = rk < K
    w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    after_previous(PDL)
    x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]  # [BLOCK_N, BLOCK_K]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, 1)


# NOTE: relaxed at system scope: a peer's polling loads (engine/parallel/symm_kernels.py) see each line whole
_PUT = tl.constexpr("st.relaxed.sys.global.u32 [$1], $2;\n mov.u32 $0, 0;")


@triton.jit
def _put(addrs, lines):
    """Store each 32-bit line at its address (a peer's symmetric buffer, mapped here)."""
    tl.inline_asm_elementwise(_PUT, "=r, l, r", [addrs, lines], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _row_product_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w, buffer_ptrs, calls_ptr, region,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[0, n-block] = x . w[n-block] (+ bias). PUSH (N a multiple of BLOCK_N): each value also into every
    peer's buffer (buffer_ptrs: each rank's) as a 32-bit line, its 16 bits low and its call's tag high, at
    ((call's half * WORLD + RANK) * region + n): engine/parallel/symm_kernels.py's pushed norm reads them."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    total = row_dot(x_ptr, w_ptr, rn, n_ok, K, stride_w, BLOCK_N, BLOCK_K, NUM_STAGES, PDL)  # waits in row_dot
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    partial = total.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rn, partial, mask=n_ok)
    if PUSH:
        # NOTE: the call the norm after it makes (that norm's own count, read past L1 as it reads it)
        epoch = tl.load(calls_ptr, cache_modifier=".cg").to(tl.uint32, bitcast=True) + 1
        lines = partial.to(tl.uint16, bitcast=True).to(tl.uint32) | ((epoch & 0xFFFF) << 16)
        buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
        for r in tl.static_range(WORLD):
            if r != RANK:
                peer = tl.load(buffers + r).to(tl.pointer_type(tl.uint32))
                _put(peer + ((epoch & 1).to(tl.int64) * WORLD + RANK) * region + rn, lines)  # NOTE: N % BLOCK_N == 0


def takes_row_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `row_product` serves x @ weight.T: one row on a CUDA device, a 16-bit weight of x's dtype with
    contiguous rows."""
    return (x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1)


class Push(NamedTuple):
    """Where `row_product` also stores its row, as 32-bit lines tagged with their call (symm_kernels' layout):
    every rank's symmetric buffer (a device array of addresses), the call count the norm after it raises, a
    region's lines, this rank and the group's size."""

    buffer_ptrs: int
    calls: torch.Tensor
    region: int
    rank: int
    world: int


def push_fits(n: int, block_n: int, region: int, element_size: int) -> bool:
    """Whether `row_product` can push a row of n outputs in tiles of block_n rows: 16-bit values, whole tiles,
    within a region."""
    return element_size == 2 and n % block_n == 0 and n <= region


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: RowConfig | None = None, push: Push | None = None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] -> [..., N] in x's dtype; config: row_config(K)'s by default.
    push: the row also into every peer's buffer (N a multiple of the tile's rows, at most push.region)."""
    n, k = weight.shape
    if x.numel() != k:
        raise ValueError(f"row_product multiplies one row of {k}; got x of shape {tuple(x.shape)}")
    row = x.reshape(k).contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or row_config(k)
    if push is not None and not push_fits(n, block_n, push.region, x.element_size()):
        raise ValueError(f"row_product pushes 16-bit rows of a multiple of {block_n} up to {push.region} values; "
                         f"got {n} of {x.dtype}")
    _row_product_kernel[(triton.cdiv(n, block_n),)](
        row, weight, bias if bias is not None else row, out, n, k, weight.stride(0),
        push.buffer_ptrs if push else 0, push.calls if push else out, push.region if push else 0,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages, PUSH=push is not None,
        RANK=push.rank if push else 0, WORLD=push.world if push else 1, num_warps=num_warps,
        **pdl_options(x.device, 1, max_rows=PDL_PRODUCT_MAX_ROWS))
    return out.reshape(*x.shape[:-1], n)
