"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
kernel before it on the stream still runs, and waits for it where its own kernel says so.

Invariant: a kernel compiled with `PDL` (`pdl_options`) calls `after_previous` before it reads anything an
earlier kernel of the step writes and before it writes anything (only such a kernel is launched with PDL);
before that it only computes addresses and reads what no kernel writes (a norm's weight), what only its own
earlier calls wrote (the fused all-reduce's call counts, read past L1), or what only kernels before the one
before it wrote (decode attention's metadata and its sequences' keys older than the step's). Its own dependents
are let in at that point, not earlier, so at most the one kernel after a running one is early: every kernel
before it has finished. (Prefetching the weights into L2 before the wait lost:
bench/results/pdl_prefetch_8b_nvidia-h200; so did a kernel of L2 prefetches a few kernels ahead of the product:
l2_prefetch_kernel_ab_8b_2xh200.)
Kernels launched without it (cuBLAS, torch, NCCL) keep the stream's order; a CUDA graph captures the same edges.
Imported only by the Triton kernel modules (it imports triton)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


PDL_ANY_MAX_ROWS = 1
PDL_PRODUCT_MAX_ROWS = 8
"""The most rows (tokens, or sequences for attention) a kernel launches with PDL for: any kernel at one row,
a weight product (FP8 split-K, 4-bit) up to 8: where each paid. On an H200 at the Llama-3.1-8B shape, decode
steps over main's, in turns in one call (bench/results/pdl_*_8b_nvidia-h200), at batch 1 / 2 / 8:
- every kernel up to 8 rows: FP8 0.93 / 0.94 / 0.97, W4A16 0.95 / 1.04 / 0.99, bfloat16 0.99 / 1.02 / 1.01
  (up to 32 rows, at batch 32: 1.035, 1.084, 1.008);
- the products alone up to 8 rows: FP8 0.94 / 0.95 / 0.98, W4A16 0.98 / 0.98 / 0.99, bfloat16 1.00 (its
  products are cuBLAS's);
- this rule: FP8 0.93 / 0.95 / 0.99, W4A16 0.95 / 0.99 / 0.99, bfloat16 0.99 / 1.00 / 1.00."""


def compiled(device: torch.device) -> bool:
    """Whether Triton compiles the kernels launched on `device` (CUDA, TRITON_INTERPRET unset): only then does
    their inline PTX run (Triton's interpreter runs none of it)."""
    return device.type == "cuda" and _compiling()


@functools.cache
def _compiling() -> bool:
    # NOTE: read once, at a CUDA device's first launch: a launcher asks for every kernel it launches
    return os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are compiled with `after_previous` (its PDL argument): `compiled`, on CUDA of
    compute capability 9.0 or more. Every kernel of a step is, so that each lets the next in early; launched
    without PDL, a kernel's wait returns at once."""
    if not compiled(device):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(device: torch.device, rows: int, max_rows: int = PDL_ANY_MAX_ROWS) -> dict[str, bool]:
    """A launch's PDL arguments: `PDL` (compiled with `after_previous`, where `pdl` holds) and `launch_pdl`
    (started while the kernel before it ends: at most `max_rows` rows; PDL_PRODUCT_MAX_ROWS for a weight
    product, 0 for a kernel that always launches in the stream's order)."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on and rows <= max_rows}


@triton.jit
def after_previous(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one on the stream has finished and its writes
    are visible, then let the kernel after this one start (it waits likewise)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
