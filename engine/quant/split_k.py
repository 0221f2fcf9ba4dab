"""The end of a split-K product tile, shared by fp8_kernels' and int4_kernels' kernels; imported only by
them (it imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_split_k(acc, out, parts, ok, pid_k, count, M, N, bias_ptr, rn, n_ok, HAS_BIAS: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """A tile's float32 sums `acc` over its K slice pid_k. One slice: bias added, `out` (pointers,
    `ok` their mask) written. Several: the slice's sums go to parts + pid_k * M * N (`parts`: the
    tile's pointers into slice 0), then the tile's `count` (zero between launches) goes up by one;
    the program that brings it to SPLIT_K adds every slice in split order (deterministic: the same
    sums whichever program is last), writes `out` and sets the count back to zero (for the next
    launch, a CUDA graph's replay too). One launch: a second, summing kernel cost a launch a product."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out.dtype.element_ty), mask=ok)
    else:
        tl.store(parts + pid_k * M * N, acc, mask=ok)
        # NOTE: every thread's stores before the count (the barrier), the count released at GPU scope;
        # the last program acquires it, and reads the slices past L1 (.cg), which may hold stale lines.
        tl.debug_barrier()
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(parts + split * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, total.to(out.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
