"""The Triton kernel behind the sampler's fused draw (engine/sampler.py, `Sampler(fused=True)`):
the exponential race over temperature-scaled logits in one pass over the logits, for rows with
no top-k, top-p, min-p or seed. Imported only when such a draw runs on CUDA (or a TRITON_INTERPRET
test asks for it).

The unfused draw reads and writes [rows, vocab] float32 about seven times (scale, softmax, noise,
clamp, divide, argmax); this one reads the logits once and writes [rows, chunks] pairs. Per token
i of a row with temperature T and Philox stream s (one int64 seed a row):

    u_i = uniform(s, i) in [0, 1),  E_i = -log(u_i) ~ Exponential(1),
    token = argmax_i (x_i / T - log E_i) = argmax_i (softmax(x / T)_i / E_i)

which is the sampler's exponential race (exact sampling from softmax(x / T)) with the noise drawn
by counter (s, i) rather than by a generator's sequence: a row's token does not depend on how the
vocabulary is split into chunks or on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 8192  # vocabulary entries per program
_BLOCK = 1024  # entries per loop iteration


@triton.jit
def _race_kernel(
    logits_ptr, inv_temp_ptr, seed_ptr, best_ptr, index_ptr, stride, vocab, num_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid (rows, chunks): the best score of chunk c of row r, and the smallest index holding it."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    seed = tl.load(seed_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        u = tl.maximum(tl.rand(seed, cols), 1.0e-30)  # NOTE: u = 0 would give E = inf: a lost race either way
        score = x * inv_temp - tl.log(-tl.log(u))
        better = ok & (score > best)  # NaN scores never win
        best = tl.where(better, score, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, 0)
    index = tl.min(tl.where(best == top, best_index, 2147483647), 0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(index_ptr + row * num_chunks + chunk, index)


def race(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, chunk: int = _CHUNK, block: int = _BLOCK
) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype), temperature [rows] (> 0), seeds [rows] int64 -> one
    token per row [rows] int64, drawn from softmax(logits / T). chunk (a multiple of block) and
    block: powers of two; only the speed depends on them (tests make them small)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    inv_temp = (1.0 / temperature).to(torch.float32)
    _race_kernel[(rows, num_chunks)](
        logits, inv_temp, seeds, best, index, logits.stride(0), vocab, num_chunks, CHUNK=chunk, BLOCK=block
    )
    winner = best.argmax(dim=1, keepdim=True)  # [rows, 1]: the first chunk holding the row's best
    # NOTE: only a row of NaN or -inf logits has no winner (index 2**31 - 1): it gets the last id,
    # a valid token, as torch's argmax gives some index for such a row.
    return index.gather(1, winner).squeeze(1).clamp_max(vocab - 1).to(torch.long)
