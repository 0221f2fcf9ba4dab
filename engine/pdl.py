"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
kernel before it on the stream still runs, and waits for it where its own kernel says so.

Invariant: a kernel launched with `launch_pdl=pdl(device, rows)` and `PDL=` the same calls
`after_previous` before it reads anything an earlier kernel writes and before it writes anything;
before that it may only compute addresses and prefetch what no kernel writes (weights). Its own
dependents are let in at that point, not earlier, so at most the one kernel after a running one is
early: every kernel before it has finished. Kernels launched without it (cuBLAS, torch, NCCL) keep
the stream's order; a CUDA graph captures the same edges. Imported only by the Triton kernel
modules (it imports triton)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


PDL_MAX_ROWS = 32
"""The most rows (tokens, or sequences for attention) a kernel launches with PDL for. On an H200 at the
Llama-3.1-8B shape it took the batch-1 decode step from 3.34 to 3.11 ms in FP8, 3.82 to 3.62 in W4A16
and 4.67 to 4.60 in bfloat16, but batch 64 from 6.76 to 6.87, 17.8 to 19.1 and 7.25 to 7.35 ms
(bench/results/quantized_llama-3.1-8b_pdl_*): kernels of many programs lose by it."""


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0) and os.environ.get("TRITON_INTERPRET") != "1"


def pdl(device: torch.device, rows: int) -> bool:
    """Whether a kernel of `rows` rows on `device` launches with programmatic dependent launch: at most
    PDL_MAX_ROWS rows, on CUDA of compute capability 9.0 or more, compiled (Triton's interpreter runs
    none of it)."""
    if device.type != "cuda" or rows > PDL_MAX_ROWS:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def after_previous(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one on the stream has finished and its writes
    are visible, then let the kernel after this one start (it waits likewise)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
