"""The draft loop's draw (engine/spec/draft_loop.py) in one Triton launch a pass.

Per row of logits x with temperature T, greedy flag g and exponential noise E (drawn before the loop's
replay; values under float32's tiny count as tiny, as the sampler's race clamps them):

    p = softmax(x / T),  token = argmax x if g else argmax_i p_i / E_i,  dist = one_hot(argmax x) if g else p

the same tokens and distributions as the torch ops it replaces (scale, softmax, two argmaxes, where,
one-hot, copies: about ten launches a pass, each reading or writing [rows, vocab]), up to the rounding
of a near-tie. One program a row, three passes over its logits (maximum, sum, then the distribution
and the race), each in as few iterations as a block of up to 8,192 entries allows: at batch 1 the
draw is one program's dependent loads, so their count sets its time. Ties go to the lowest index,
as torch's argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 8192  # vocabulary entries per loop iteration, at most (a vocabulary up to it: one iteration a pass)
_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny
_NO_INDEX = tl.constexpr(2147483647)


@triton.jit
def _draft_draw_kernel(logits_ptr, logits_stride, temperature_ptr, greedy_ptr, noise_ptr, noise_stride, tokens_ptr,
                       dists_ptr, dists_stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = tl.load(greedy_ptr + row) != 0
    lanes = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    top_index = tl.full([BLOCK], _NO_INDEX, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=cols < vocab, other=float("-inf"))
        better = x > top  # NOTE: a lane keeps its first maximum: later equal values are not better
        top = tl.where(better, x, top)
        top_index = tl.where(better, cols, top_index)
    peak = tl.max(top, 0)
    argmax = tl.minimum(tl.min(tl.where(top == peak, top_index, _NO_INDEX), 0), vocab - 1)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=cols < vocab, other=float("-inf"))
        total += tl.exp((x - peak) / temperature)
    inv_total = 1.0 / tl.sum(total, 0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], _NO_INDEX, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        ok = cols < vocab
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=ok, other=float("-inf"))
        p = tl.exp((x - peak) / temperature) * inv_total
        noise = tl.maximum(tl.load(noise_ptr + row * noise_stride + cols, mask=ok, other=1.0), _TINY)
        score = p / noise
        better = ok & (score > best)
        best = tl.where(better, score, best)
        best_index = tl.where(better, cols, best_index)
        dist = tl.where(greedy, tl.where(cols == argmax, 1.0, 0.0), p)
        tl.store(dists_ptr + row * dists_stride + cols, dist, mask=ok)
    raced = tl.minimum(tl.min(tl.where(best == tl.max(best, 0), best_index, _NO_INDEX), 0), vocab - 1)
    tl.store(tokens_ptr + row, tl.where(greedy, argmax, raced).to(tl.int64))


def draft_draw(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, noise: torch.Tensor,
               tokens: torch.Tensor, dists: torch.Tensor, block: int | None = None) -> None:
    """logits [rows, vocab] float32, temperature [rows] of any float dtype (> 0; a greedy row's is unused
    but must not be 0; the loop passes float64), greedy [rows] of bool or any integer dtype (nonzero:
    greedy; the loop passes int64), noise [rows, vocab] float32 -> tokens [rows] int64 and dists
    [rows, vocab] float32, written in place (the module docstring's draw). block: a power of two (by
    default the vocabulary's, up to _MAX_BLOCK); only the speed depends on it."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or noise.shape != logits.shape or dists.shape != logits.shape:
        raise ValueError(f"logits, noise and dists must be [rows, vocab] float32 alike; got {logits.dtype} "
                         f"{tuple(logits.shape)}, {tuple(noise.shape)}, {tuple(dists.shape)}")
    if tokens.shape != (rows,) or temperature.shape != (rows,) or greedy.shape != (rows,):
        raise ValueError(f"tokens, temperature and greedy must be [{rows}]; got {tuple(tokens.shape)}, "
                         f"{tuple(temperature.shape)}, {tuple(greedy.shape)}")
    for name, t in (("logits", logits), ("noise", noise), ("dists", dists)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the vocabulary (stride {t.stride(1)})")
    if block is None:
        block = min(triton.next_power_of_2(vocab), _MAX_BLOCK)
    if rows:
        _draft_draw_kernel[(rows,)](logits, logits.stride(0), temperature, greedy, noise, noise.stride(0), tokens,
                                    dists, dists.stride(0), vocab, BLOCK=block, num_warps=8 if block >= 4096 else 4)
