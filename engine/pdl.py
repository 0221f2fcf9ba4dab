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


PDL_MAX_ROWS = 8
"""The most rows (tokens, or sequences for attention) a kernel launches with PDL for: where it paid. On an
H200 at the Llama-3.1-8B shape (main against PDL up to 32 rows, in turns in one call), decode steps over
main's at batch 1 / 8 / 32 / 64: FP8 0.929 / 0.965 / 1.035 / 0.983, W4A16 0.949 / 0.978 / 1.084 / 0.997,
bfloat16 0.992 / 1.018 / 1.008 / 1.000 (bench/results/pdl_*_8b_nvidia-h200): a product of many
programs loses by it, the small products gain."""


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
