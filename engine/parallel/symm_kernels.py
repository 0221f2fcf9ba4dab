"""A row-parallel projection's all-reduce fused with the residual add and RMSNorm that follow it, in one
kernel on the group's symmetric memory (engine/parallel/symmetric.py): each program takes one row, copies
this rank's partial sums into its buffer, meets its peers' programs of the same row (signals over NVLink),
sums every rank's row in rank order, adds the residual and writes the new residual and the norm (quantized
for an FP8 projection). A decode step's all-reduce and the norm after it were two launches, the all-reduce's
result going through memory between them.

The barrier is per row: program r of every rank sets its flag in each peer's signal pad and waits for each
peer's flag in its own, resetting it (so the pad is all zeros between calls, which CUDA graphs need). A
second barrier at the end keeps a fast rank from writing its next partial sums into the buffer while a peer
still reads this call's. Every rank sums in rank order, so all hold the same bits. CUDA only (PTX)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engine.models.fused_kernels import norm_row
from engine.quant.fp8 import FP8, QuantizedRows

__all__ = ["allreduce_add_rms_norm"]


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


def _flag_swap_asm(sem: str, want: int, then: int) -> tl.constexpr:
    """PTX that waits for the 32-bit flag at $1 to hold `want` and swaps in `then` (one compare-and-swap a try,
    with `sem` ordering: release publishes this program's writes before it, acquire sees a peer's)."""
    return tl.constexpr(f"""
        {{
            .reg .u32 %old;
            .reg .pred %done;
        again:
            atom.{sem}.sys.global.cas.b32 %old, [$1], {want}, {then};
            setp.eq.u32 %done, %old, {want};
            @!%done bra again;
        }}
        """)


_RAISE = _flag_swap_asm("release", 0, 1)  # a peer's flag 0 -> 1, waiting while it has not taken the last one
_TAKE = _flag_swap_asm("acquire", 1, 0)  # this rank's flag 1 -> 0 once the peer raised it: zeros between calls


@triton.jit
def _swap_flags(addrs, ASM: tl.constexpr):
    """Each flag at `addrs` as ASM (_RAISE or _TAKE) swaps it."""
    tl.inline_asm_elementwise(ASM, "=r, l", [addrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _meet(signal_pads, block, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `block` of every rank meets here: after it, each rank's writes before it are visible to all."""
    ranks = tl.arange(0, WORLD)
    pads = signal_pads.to(tl.pointer_type(tl.uint64))
    peers = tl.load(pads + ranks).to(tl.pointer_type(tl.uint32))
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
    tl.debug_barrier()  # NOTE: every thread's writes of this program are done before one thread signals
    if _thread_index() < WORLD:
        _swap_flags(peers + block * WORLD + RANK, _RAISE)
        _swap_flags(own + block * WORLD + ranks, _TAKE)
    tl.debug_barrier()


@triton.jit
def _allreduce_add_rms_norm_kernel(
    buffer_ptrs, signal_pads, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, n, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One program a row: h = round(sum over ranks of x, rank order) [+ residual, rounded], stored as the
    new residual; out = norm(h) as `_add_rms_norm_kernel` computes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    mine = tl.load(buffers + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
    tl.store(mine + row * n + cols, x, mask=ok)
    _meet(signal_pads, row, RANK, WORLD)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        peer = tl.load(buffers + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
        acc += tl.load(peer + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    h = acc.to(x_ptr.dtype.element_ty)  # NOTE: what the all-reduce alone returns, rounded
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_ro + cols, h, mask=ok)
    norm_row(h, w_ptr, out_ptr, scale_ptr, row, stride_o, cols, ok, n, eps, QUANTIZE)
    _meet(signal_pads, row, RANK, WORLD)  # NOTE: every peer has read this row before any rank writes the next call's


def allreduce_add_rms_norm(
    handle: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """x: this rank's partial sums [tokens, n] (contiguous; tokens * n elements fit the buffer); returns
    (norm of (sum over ranks of x) + residual, that sum + residual) as DecoderOps.add_rms_norm does (the norm
    quantized for an FP8 projection). `handle`: the group's symmetric memory (rendezvous'd); every rank calls
    it at once, in the same order as its other collectives."""
    tokens, n = x.shape
    out = torch.empty((tokens, n), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device) if quantize else out
    res_out = torch.empty_like(x)
    res = residual if residual is not None else x
    if tokens:
        _allreduce_add_rms_norm_kernel[(tokens,)](
            handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, x, res, weight, out, res_out, scale,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), n, eps,
            RANK=handle.rank, WORLD=handle.world_size, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8,
        )  # fmt: skip
    return (QuantizedRows(out, scale, x.dtype) if quantize else out), res_out
