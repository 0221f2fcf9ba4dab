"""A row-parallel projection's all-reduce fused with the residual add and RMSNorm that follow it, in one
kernel on the group's symmetric memory (engine/parallel/symmetric.py): each program takes one row, copies
this rank's partial sums into its buffer, meets its peers' programs of the same row (signals over NVLink),
sums every rank's row in rank order, adds the residual and writes the new residual and the norm (quantized
for an FP8 projection). A decode step's all-reduce and the norm after it were two launches, the all-reduce's
result going through memory between them.

The barrier is per row: program r of every rank stores its row's call count into its flag in each peer's
signal pad and waits for each peer's flag in its own to reach that count. The row's calls alternate between
two halves of the buffer, so a fast rank's next partial sums never land where a peer still reads this call's,
without a second barrier. The kernel owns its buffer's signal pads (counts left in them would break another
kernel's barriers). Every rank sums in rank order, so all hold the same bits. CUDA only (PTX).

At one row a row-parallel product can push its row into the peers' buffers as it makes it
(row_kernels.row_product's PUSH), each 16-bit value a 32-bit line with its call's tag in the high half (NCCL's
LL protocol at half its width), and `pushed_add_rms_norm` then polls its own buffer for its peers' lines: no
meeting, and the exchange overlaps the product (README, tensor parallelism: what it gained; the same protocol
inside this kernel, the partial sums stored after the product, lost)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from engine.models.fused_kernels import norm_row
from engine.pdl import after_previous, pdl_options
from engine.parallel.symmetric import ONE_SHOT_MAX_BYTES
from engine.quant.fp8 import FP8, QuantizedRows

__all__ = ["allreduce_add_rms_norm", "pushed_add_rms_norm"]


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


# NOTE: flags hold each row's call count (epochs), never reset: a peer's flag at or past ours means it arrived
_RAISE = tl.constexpr("st.release.sys.global.u32 [$1], $2;\n mov.u32 $0, 0;")
_WAIT = tl.constexpr("""
        {
            .reg .u32 %seen;
            .reg .s32 %behind;
            .reg .pred %wait;
        again:
            ld.acquire.sys.global.u32 %seen, [$1];
            sub.s32 %behind, %seen, $2;
            setp.lt.s32 %wait, %behind, 0;
            @%wait bra again;
            mov.u32 $0, 0;
        }
        """)


@triton.jit
def _flags(addrs, epoch, ASM: tl.constexpr):
    """Each flag at `addrs` as ASM says: _RAISE stores `epoch` into it (release: this program's writes before
    it are visible to whoever sees it), _WAIT waits for it to reach `epoch` (acquire: the writer's are)."""
    tl.inline_asm_elementwise(ASM, "=r, l, r", [addrs, epoch], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _meet(peers, own, block, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `block` of every rank meets here for its `epoch`-th call: after it, each rank's writes before
    it are visible to all (peers: every rank's signal pad, own: this rank's). A peer is at most one call
    ahead (its next meeting waits for ours), and the signed difference keeps the count's wrap harmless."""
    ranks = tl.arange(0, WORLD)
    epochs = tl.full([WORLD], 0, tl.uint32) + epoch
    tl.debug_barrier()  # NOTE: every thread's writes of this program are done before one thread signals
    if _thread_index() < WORLD:
        _flags(peers + block * WORLD + RANK, epochs, _RAISE)
        _flags(own + block * WORLD + ranks, epochs, _WAIT)
    tl.debug_barrier()


@triton.jit
def _allreduce_add_rms_norm_kernel(
    buffer_ptrs, signal_pads, calls_ptr, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, n, half, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program a row: h = round(sum over ranks of x, rank order) [+ residual, rounded], stored as the
    new residual; out = norm(h) as `_add_rms_norm_kernel` computes it. The row's calls alternate between
    the buffer's two halves (`half` elements each), so one meeting a call suffices: a rank writes a half
    again only two calls on, after every peer has met it for the call between, so done reading it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    # NOTE: before the wait, what no other kernel writes: the norm's weight, the buffers' and pads' addresses,
    # and this row's calls so far (this kernel's own count, the same on every rank; unsigned, so its wrap is
    # defined), read past L1
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    mine = tl.load(buffers + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
    pads = signal_pads.to(tl.pointer_type(tl.uint64))
    peers = tl.load(pads + tl.arange(0, WORLD)).to(tl.pointer_type(tl.uint32))
    own = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
    epoch = tl.load(calls_ptr + row, cache_modifier=".cg").to(tl.uint32, bitcast=True) + 1
    after_previous(PDL)
    tl.store(calls_ptr + row, epoch.to(tl.int32, bitcast=True))
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    base = (epoch & 1).to(tl.int64) * half + row * n
    tl.store(mine + base + cols, x, mask=ok)
    _meet(peers, own, row, epoch, RANK, WORLD)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        peer = tl.load(buffers + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
        acc += tl.load(peer + base + cols, mask=ok, other=0.0).to(tl.float32)
    _add_norm(acc.to(x_ptr.dtype.element_ty), w, res_ptr, out_ptr, res_out_ptr, scale_ptr, row, stride_r, stride_o,
              stride_ro, cols, ok, n, eps, HAS_RESIDUAL, QUANTIZE)


@triton.jit
def _add_norm(h, w, res_ptr, out_ptr, res_out_ptr, scale_ptr, row, stride_r, stride_o, stride_ro, cols, ok, n, eps,
              HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr):
    """h: the rounded sum over the ranks (what the all-reduce alone returns) -> [+ residual, rounded] stored as
    the new residual, and its norm."""
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(h.dtype)
    tl.store(res_out_ptr + row * stride_ro + cols, h, mask=ok)
    norm_row(h, w, out_ptr, scale_ptr, row, stride_o, cols, ok, n, eps, QUANTIZE)


@triton.jit
def _pushed_add_rms_norm_kernel(
    buffer_ptrs, calls_ptr, x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, n, region, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """`_allreduce_add_rms_norm_kernel` for one row whose peers' partial sums their products pushed into this
    rank's buffer (row_kernels.row_product's PUSH: lines of 16 bits and the call's tag, source r's at
    ((half * WORLD + r) * region)); x: this rank's, from its own product. No meeting: a line with this call's tag
    holds this call's value (a 32-bit store is seen whole). A peer writes a half again only two calls on, after
    this rank's product of the call between, which runs after this call's norm has read it."""
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    # NOTE: before the wait, what no other kernel writes: the norm's weight, the buffer's address, and the calls so
    # far (this kernel's own count, the same on every rank; unsigned, so its wrap is defined), read past L1
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    mine = tl.load(buffer_ptrs.to(tl.pointer_type(tl.uint64)) + RANK).to(tl.pointer_type(tl.uint32))
    epoch = tl.load(calls_ptr, cache_modifier=".cg").to(tl.uint32, bitcast=True) + 1
    after_previous(PDL)
    tl.store(calls_ptr, epoch.to(tl.int32, bitcast=True))
    x = tl.load(x_ptr + cols, mask=ok, other=0.0)
    tag = epoch & 0xFFFF
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            lines = _take(mine + ((epoch & 1).to(tl.int64) * WORLD + r) * region + cols, tag, ok)
            acc += (lines & 0xFFFF).to(tl.uint16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    _add_norm(acc.to(x_ptr.dtype.element_ty), w, res_ptr, out_ptr, res_out_ptr, scale_ptr, 0, 0, 0, 0, cols, ok, n,
              eps, HAS_RESIDUAL, QUANTIZE)


@triton.jit
def _take(addrs, tag, ok):
    """The lines at `addrs` once every one in `ok` carries `tag`: each pass loads them all at once (volatile:
    from memory, not a cache), then counts those still missing."""
    lines = tl.load(addrs, mask=ok, other=0, volatile=True)
    missing = tl.sum(((lines >> 16) != tag).to(tl.int32) * ok.to(tl.int32), 0)
    while missing > 0:
        lines = tl.load(addrs, mask=ok, other=0, volatile=True)
        missing = tl.sum(((lines >> 16) != tag).to(tl.int32) * ok.to(tl.int32), 0)
    return lines


def allreduce_add_rms_norm(
    handle: Any, calls: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
    eps: float, quantize: bool
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """x: this rank's partial sums [tokens, n] (contiguous; tokens * n elements fit half the buffer); returns
    (norm of (sum over ranks of x) + residual, that sum + residual) as DecoderOps.add_rms_norm does (the norm
    quantized for an FP8 projection). `handle`: this kernel's own symmetric buffer (rendezvous'd; its signal
    pads zeroed, then only this kernel's); `calls`: int32 zeros, a row's count of calls, one a row. Every rank
    calls it at once, in the same order as its other collectives."""
    tokens, n = x.shape
    out = torch.empty((tokens, n), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device) if quantize else out
    res_out = torch.empty_like(x)
    res = residual if residual is not None else x
    if tokens:
        _allreduce_add_rms_norm_kernel[(tokens,)](
            handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, calls, x, res, weight, out, res_out, scale,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), n, ONE_SHOT_MAX_BYTES // x.element_size(),
            eps,
            RANK=handle.rank, WORLD=handle.world_size, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8,
            **pdl_options(x.device, tokens),
        )  # fmt: skip
    return (QuantizedRows(out, scale, x.dtype) if quantize else out), res_out


def pushed_add_rms_norm(
    handle: Any, calls: torch.Tensor, region: int, x: torch.Tensor, residual: torch.Tensor | None,
    weight: torch.Tensor, eps: float, quantize: bool
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """`allreduce_add_rms_norm` of one row x [1, n] whose product pushed it into every peer's buffer (`handle`:
    that buffer's rendezvous, 2 * world regions of `region` 32-bit lines, zeroed; `calls`: its one int32 count,
    which the product read too)."""
    tokens, n = x.shape
    if tokens != 1 or n > region or x.element_size() != 2:
        raise ValueError(f"the pushed norm takes one 16-bit row of at most {region}; got {tokens} x {n} {x.dtype}")
    out = torch.empty((1, n), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty((1, 1), dtype=torch.float32, device=x.device) if quantize else out
    res_out = torch.empty_like(x)
    _pushed_add_rms_norm_kernel[(1,)](
        handle.buffer_ptrs_dev, calls, x, residual if residual is not None else x, weight, out, res_out, scale, n,
        region, eps, RANK=handle.rank, WORLD=handle.world_size, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
        BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8, **pdl_options(x.device, 1),
    )  # fmt: skip
    return (QuantizedRows(out, scale, x.dtype) if quantize else out), res_out
