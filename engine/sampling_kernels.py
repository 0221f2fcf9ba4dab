"""The Triton kernels behind the sampler's fused paths (engine/sampler.py, `Sampler(fused=True)`),
for rows with no top-k, top-p or min-p: `race`, the exponential race over temperature-scaled logits
in one pass over the logits (a greedy row's argmax in the same launch), `keyed_noise`, the race's
noise of seeded rows for the sampler's torch path, and `verify`, speculative decoding's verification
of greedy rows and rejection sampling of unseeded random rows in one launch.
Imported only when such a draw runs on CUDA (or a TRITON_INTERPRET test asks for it).

The unfused draw reads and writes [rows, vocab] float32 about seven times (scale, softmax, noise,
clamp, divide, argmax); `race` reads the logits once and writes [rows, chunks] pairs. Per token i
of a row with temperature T and 64-bit key s (a seeded row's `draw_seed(seed, n)`, another row's
from a value drawn from the engine's generator and the launch's step; the kernel computes both,
engine/draw_keys.py says how):

    E_i = torch_exponential(s, i),  token = argmax_i (x_i / T - log E_i) = argmax_i (softmax(x / T)_i / E_i)

the sampler's exponential race (exact sampling from softmax(x / T)). `torch_exponential(s, i)` is
the value torch's CUDA `exponential_` writes at element i of a [vocab] tensor from a generator
freshly seeded with s (`torch.Generator("cuda").manual_seed(s)`), which is how the sampler's torch
path draws a seeded row's noise: its Philox4x32-10 uniform (key s, counter (call, 0, thread, 0), as
curand_init(s, thread, 0) and the call-th curand_uniform4 give it, torch's grid of `threads`
threads striding the tensor, four uniforms a call), mapped to (0, 1] and through torch's -log. So a
seeded row's token here is the torch path's token for the same (seed, position) on a GPU, up to
the rounding of a near-tie, and a row's token never depends on the chunking of the vocabulary or
on the other rows.

`verify`, per row of drafts d_0..d_{K-1} (q_k their draft distributions, point masses for n-gram
drafts) and target distributions p_0..p_K (softmax(x / T) at the K + 1 positions), one program a
row and one Philox stream s a row (Leviathan et al., 2023):

    accept d_k iff u_k q_k(d_k) < p_k(d_k), u_k = uniform(s, vocab + k)   (probability min(1, p / q))
    m = the first rejected k, or K
    last token ~ max(0, p_m - q_m) (m < K; p_m where that is all zero), or ~ p_K (m = K: the bonus),
                 by the race above with u_i = uniform(s, i)

which emits d_0..d_{m-1} and the last token, distributed exactly as the target's own tokens. The
softmax statistics of all K + 1 positions come from one pass over [positions, vocabulary] tiles, the
last token from a second pass at position m: two passes a row, whatever K. A greedy row (T = 0)
takes the argmax of each position from the first pass: it accepts the drafts equal to it and ends
with the argmax at m (the lowest index of a tie, as torch's argmax), and skips the second.
"""

from __future__ import annotations

import functools
import itertools
import os
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.random import philox

from engine.direct_launch import DirectLaunch
from engine.pinned import upload

if TYPE_CHECKING:
    from engine.request import DeviceTokens

_CHUNK = 8192  # vocabulary entries per program
_BLOCK = 1024  # entries per loop iteration
# `verify`: entries per iteration of its first pass (a [K + 1 padded, vocab] tile) and of its second
# (vocab). Batch 1, K = 4 on an H100: 17 us at vocab 8192, 230 us at 151,936 (8 warps, 4096-entry
# tiles: 18 and 270; 4 warps, 2048: 23 and 380).
_VERIFY_TILE = 8192
_VERIFY_BLOCK = 2048
_VERIFY_WARPS = 16


# torch's CUDA random fills (ATen's DistributionTemplates.h): blocks of 256 threads, at most as many
# blocks as the device keeps resident (SMs x 2048 / 256), each thread striding the tensor.
_TORCH_BLOCK = 256
_UNIFORM_SCALE = tl.constexpr(2.3283064365386963e-10)  # 2**-32: curand_uniform maps x to x * 2**-32 + 2**-33, in (0, 1]
_NEAR_ONE = tl.constexpr(0.99999994)  # 1 - 2**-24: from here torch takes log(u) = -2**-24 (float32 epsilon / 2)

if os.environ.get("TRITON_INTERPRET") == "1":  # NOTE: the interpreter (CPU tests) has no libdevice

    @triton.jit
    def _logf(x):
        return tl.log(x)

else:

    @triton.jit
    def _logf(x):
        """CUDA's __logf (the fast one): torch's exponential_ takes the log of its uniforms with it,
        bit for bit (bench/diag/noise_variants.py; CUDA's accurate logf differs in the last bits)."""
        return libdevice.fast_logf(x)


@functools.cache
def torch_threads(numel: int, device: torch.device) -> int:
    """Threads of torch's CUDA random fill of `numel` floats on `device`: element i is drawn by thread
    i mod threads, from its (i div threads)-th uniform. On the CPU (the interpreter) a grid that
    covers the tensor, as torch's does on a GPU for a vocabulary up to 2048 x 8 x its SMs / 8."""
    blocks = triton.cdiv(numel, _TORCH_BLOCK)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        blocks = min(blocks, props.multi_processor_count * (props.max_threads_per_multi_processor // _TORCH_BLOCK))
    return blocks * _TORCH_BLOCK


@triton.jit
def _torch_exponential(key, cols, threads):
    """E ~ Exponential(1) at elements `cols` of torch's CUDA `exponential_` from a generator seeded
    with `key` (int64 bits of the 64-bit seed), its fill run by `threads` threads."""
    thread = cols % threads
    uniform = cols // threads  # the thread's uniform: its Philox call uniform // 4 (curand_uniform4), word uniform % 4
    call = (uniform // 4).to(tl.uint32)
    zero = call * 0
    w0, w1, w2, w3 = philox(key, call, zero, thread.to(tl.uint32), zero)
    word = uniform % 4
    x = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    # NOTE: x * 2**-32 is exact, so FMA or not, the sum rounds once, as in curand_uniform
    u = x.to(tl.float32) * _UNIFORM_SCALE + _UNIFORM_SCALE / 2
    log_u = tl.where(u >= _NEAR_ONE, -(1.0 - _NEAR_ONE), _logf(u))
    return -log_u  # in [2**-24, 23]: never 0, never inf


@triton.jit
def _splitmix64(x):
    """engine/draw_keys.py's _splitmix64 of uint64 values (wrapping products)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


# NOTE: step changes at every launch: not specialized (one variant; warm-up compiles it).
@triton.jit(do_not_specialize=["step"])
def _race_kernel(
    logits_ptr, draw_ptr, step, words_ptr, word_row_ptr, best_ptr, index_ptr, count_ptr, out_ptr, stride,
    words_stride, vocab, num_chunks, threads, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Grid (rows, chunks): chunk c of row r finds its best score and the smallest index holding it;
    the row's token (out[r], int64) is the first chunk's holding the row's best, picked by whichever
    of the row's programs ends last (CHUNKS: num_chunks to the next power of two; with one chunk the
    program writes it). draw_ptr: row r's a, b at 3r, 3r + 1, its key splitmix64(a ^ (b + step)), and its
    1 / T's float64 bits at 3r + 2 (rounded to float32 here, as torch rounds a Python float); 1 / T = inf (a
    greedy row): its score is its logit, no noise drawn, so its token is the argmax (the lowest index of a tie;
    a NaN logit never wins, where torch's argmax would return it).
    MASKED: row r may take token t only if bit t % 32 of words[word_row[r], t // 32] is set (no mask where
    word_row[r] < 0)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    a = tl.load(draw_ptr + 3 * row).to(tl.uint64, bitcast=True)
    b = tl.load(draw_ptr + 3 * row + 1).to(tl.uint64, bitcast=True)
    key = _splitmix64(a ^ (b + step.to(tl.uint64))).to(tl.int64, bitcast=True)
    inv_temp = tl.load(draw_ptr + 3 * row + 2).to(tl.float64, bitcast=True).to(tl.float32)
    greedy = inv_temp == float("inf")
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    if MASKED:
        word_row = tl.load(word_row_ptr + row).to(tl.int64)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if MASKED:  # NOTE: a word loaded by its 32 lanes at once (one transaction), none for a row without a mask
            has_words = ok & (cols * 0 + word_row >= 0)
            word = tl.load(words_ptr + word_row * words_stride + cols // 32, mask=has_words, other=-1)
            x = tl.where(((word >> (cols % 32)) & 1) != 0, x, float("-inf"))
        if greedy:
            score = x
        else:
            score = x * inv_temp - tl.log(_torch_exponential(key, cols, threads))
        better = ok & (score > best)  # NaN scores never win
        best = tl.where(better, score, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, 0)
    # NOTE: only a chunk of NaN or -inf scores has no index (2**31 - 1): the last id stands in, a valid token
    index = tl.minimum(tl.min(tl.where(best == top, best_index, 2147483647), 0), vocab - 1)
    if CHUNKS == 1:
        tl.store(out_ptr + row, index.to(tl.int64))
    else:
        tl.store(best_ptr + row * num_chunks + chunk, top)
        tl.store(index_ptr + row * num_chunks + chunk, index)
        # NOTE: as split_k.store_split_k: the stores before the count (barrier, release at GPU scope); the
        # last program acquires it and reads the chunks past L1 (.cg); it leaves the count zero for the next
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
            chunks = tl.arange(0, CHUNKS)
            there = chunks < num_chunks
            tops = tl.load(best_ptr + row * num_chunks + chunks, mask=there, other=float("-inf"), cache_modifier=".cg")
            indices = tl.load(index_ptr + row * num_chunks + chunks, mask=there, other=0, cache_modifier=".cg")
            first = tl.min(tl.where(there & (tops == tl.max(tops, 0)), chunks, CHUNKS), 0)  # all -inf: chunk 0
            tl.store(out_ptr + row, tl.sum(tl.where(chunks == first, indices, 0), 0).to(tl.int64))
            tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


_RACE = DirectLaunch(_race_kernel)
"""The race's launches: one a step (engine/direct_launch.py)."""


def race_counts(rows: int, device: torch.device) -> torch.Tensor:
    """A zeroed count a row for `race` (each launch leaves it zeroed): one a caller keeps per device
    and stream, grown when a launch has more rows."""
    return torch.zeros(max(rows, 1), dtype=torch.int32, device=device)


def race(
    logits: torch.Tensor, draws: torch.Tensor, step: int, chunk: int = _CHUNK, block: int = _BLOCK,
    threads: int | None = None, words: torch.Tensor | None = None, word_rows: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype), draws [3 * rows] int64 and step in [0, 2**31) (engine/
    draw_keys.py's RaceRows: row r's (a, b, float64 bits of 1 / T > 0), its key splitmix64(a ^ (b + step)))
    -> one token per row [rows] int64, drawn from softmax(logits / T), in one launch. chunk (a multiple
    of block) and block: powers of two; only the speed depends on them (tests make them small).
    threads: torch's fill's (`torch_threads`, the default).
    words [m, ceil(vocab / 32)] int32 and word_rows [rows] int32 (on the logits' device): a grammar's
    bitmask (bit t set: token t allowed) for row r in words[word_rows[r]], none where it is < 0; the
    same tokens as masking the logits to -inf first, read in the same pass.
    counts: `race_counts`' buffer of at least rows (one is made here without it)."""
    rows, vocab = logits.shape
    if draws.dtype != torch.int64 or draws.shape != (3 * rows,):
        raise ValueError(f"draws must be [3 * rows] = [{3 * rows}] int64; got {tuple(draws.shape)} {draws.dtype}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    num_chunks = triton.cdiv(vocab, chunk)
    out = torch.empty(rows, dtype=torch.long, device=device)
    if num_chunks > 1:
        best = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
        index = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
        counts = counts if counts is not None else race_counts(rows, device)
        if counts.numel() < rows:
            raise ValueError(f"counts holds {counts.numel()} rows; the race has {rows}")
    else:
        best = index = counts = out  # NOTE: unused with one chunk
    threads = threads or torch_threads(vocab, device)
    masked = words is not None
    if masked and (word_rows is None or word_rows.shape != (rows,) or words.shape[1] * 32 < vocab):
        raise ValueError(f"words must be [m, >= {-(-vocab // 32)}] with word_rows [{rows}]; got "
                         f"{tuple(words.shape)} and {None if word_rows is None else tuple(word_rows.shape)}")
    if rows:
        words, word_rows = (words, word_rows) if masked else (draws, draws)
        stride, words_stride = logits.stride(0), words.stride(0) if masked else 0
        # NOTE: DirectLaunch's key: what Triton specializes the kernel on (step is not specialized)
        key = (device, logits.dtype, stride, words_stride, vocab, num_chunks, threads, chunk, block, masked,
               *(t.data_ptr() % 16 == 0 for t in (logits, draws, words, word_rows, best, index, counts, out)))
        _RACE(key, (rows, num_chunks, 1), logits, draws, step, words, word_rows, best, index, counts, out, stride,
              words_stride, vocab, num_chunks, threads, chunk, block, triton.next_power_of_2(num_chunks), masked)
    return out


# NOTE: keys may start anywhere in an upload of (rows, keys): not specialized on their alignment,
# one variant for every batch (engine/warmup.py compiles it at start).
@triton.jit(do_not_specialize_on_alignment=["key_ptr"])
def _noise_kernel(key_ptr, out_ptr, vocab, threads, BLOCK: tl.constexpr):
    """Grid (rows, blocks): row r's noise at one block of the vocabulary."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(key_ptr + row)
    tl.store(out_ptr + row * vocab + cols, _torch_exponential(key, cols, threads), mask=cols < vocab)


def keyed_noise(keys: torch.Tensor, vocab: int, block: int = _BLOCK, threads: int | None = None) -> torch.Tensor:
    """keys [rows] int64 (a 64-bit key's bits) -> [rows, vocab] float32: row r what torch's CUDA
    `exponential_` writes into a [vocab] tensor from a generator seeded with keys[r], in one launch."""
    rows = keys.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=keys.device)
    threads = threads or torch_threads(vocab, keys.device)
    _noise_kernel[(rows, triton.cdiv(vocab, block))](keys, out, vocab, threads, BLOCK=block)
    return out


# ---- speculative verification: rejection sampling (Leviathan et al., 2023) in one launch


# NOTE: rows and max_drafts change from step to step: not specialized (see
# engine/attention/triton_kernels.py's _decode_kernel).
@triton.jit(do_not_specialize=["rows", "max_drafts"])
def _verify_kernel(logits_ptr, logits_stride, q_ptr, q_stride, host_ptr, seed_ptr, out_ptr, rows, max_drafts, vocab,
                   K_BLOCK: tl.constexpr, STATS_BLOCK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Grid (rows,): row r's accepted drafts m into out[r], its last token into out[rows + r].

    host_ptr (int32), blocks of `rows` entries but the last: | first logits row | K | first q row
    (-1: point masses) | temperature (float32 bits; 0: greedy) | drafts, max_drafts a row, zero-padded |.
    A greedy row accepts the drafts that are each position's argmax (the lowest index of a tie, as
    torch's argmax) and ends with the argmax after them: pass 1 alone.
    NOTE: masks bound a block by a scalar (cols < limit) rather than `& flag`: the interpreter
    mistypes a block & a scalar.
    """
    row = tl.program_id(0)
    start = tl.load(host_ptr + row).to(tl.int64)
    num_drafts = tl.load(host_ptr + rows + row)
    q_start = tl.load(host_ptr + 2 * rows + row)
    temperature = tl.load(host_ptr + 3 * rows + row).to(tl.float32, bitcast=True)
    greedy = temperature == 0.0
    temperature = tl.where(greedy, 1.0, temperature)  # NOTE: a greedy row's statistics: its argmax alone
    seed = tl.load(seed_ptr + row)
    q_row = q_ptr + tl.maximum(q_start, 0).to(tl.int64) * q_stride  # the row's first draft distribution
    num_q = tl.where(q_start >= 0, num_drafts, 0)  # draft distributions to read: K, or 0 for point masses

    # Pass 1, the K + 1 positions at once: the max and the sum of exp(x / T - max), online.
    ks = tl.arange(0, K_BLOCK)  # positions; those past K are padding
    position_ptr = logits_ptr + (start + ks)[:, None] * logits_stride  # [K_BLOCK, 1]
    top = tl.full([K_BLOCK, STATS_BLOCK], float("-inf"), tl.float32)
    top_index = tl.full([K_BLOCK, STATS_BLOCK], 2147483647, tl.int32)
    total = tl.zeros([K_BLOCK, STATS_BLOCK], tl.float32)
    for col in range(0, vocab, STATS_BLOCK):
        cols = col + tl.arange(0, STATS_BLOCK)
        tile_ok = (ks <= num_drafts)[:, None] & (cols < vocab)[None, :]
        tile = tl.load(position_ptr + cols[None, :], mask=tile_ok, other=float("-inf")).to(tl.float32) / temperature
        top_index = tl.where(tile > top, cols[None, :], top_index)  # NOTE: a lane keeps its first maximum
        new_top = tl.maximum(top, tile)
        tile_shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # NOTE: -inf - -inf would be NaN
        total = total * tl.exp(top - tile_shift) + tl.exp(tile - tile_shift)
        top = new_top
    row_top = tl.max(top, 1)
    argmax = tl.minimum(tl.min(tl.where(top == row_top[:, None], top_index, 2147483647), 1), vocab - 1)
    shift = tl.where(row_top == float("-inf"), 0.0, row_top)  # [K_BLOCK]
    total = tl.sum(total * tl.exp(top - shift[:, None]), 1)
    total = tl.where(total > 0, total, 1.0)  # padding: p = 0 rather than 0 / 0

    # The drafts: accept d_k with probability min(1, p_k(d_k) / q_k(d_k)); m: the first rejection, or K.
    drafted = ks < num_drafts
    drafts = tl.load(host_ptr + 4 * rows + row * max_drafts + ks, mask=drafted, other=0)
    in_vocab = (drafts >= 0) & (drafts < vocab)
    x_draft = tl.load(logits_ptr + (start + ks) * logits_stride + drafts, mask=drafted & in_vocab,
                      other=float("-inf")).to(tl.float32)  # fmt: skip
    p_draft = tl.exp(x_draft / temperature - shift) / total
    q_draft = tl.load(q_row + ks * q_stride + drafts, mask=(ks < num_q) & in_vocab, other=1.0).to(tl.float32)
    u_accept = tl.rand(seed, vocab + ks)  # NOTE: counters past the race's 0..vocab - 1: independent of its noise
    # NOTE: u < p / q (u in [0, 1)) rather than <=: a token of p = 0 is never accepted, even at u = 0
    rejected = drafted & tl.where(greedy, drafts != argmax, u_accept * q_draft >= p_draft)
    m = tl.min(tl.where(rejected, ks, K_BLOCK), 0)
    m = tl.minimum(m, num_drafts)
    shift_m = tl.sum(tl.where(ks == m, shift, 0.0), 0)
    total_m = tl.sum(tl.where(ks == m, total, 0.0), 0)

    # Pass 2, position m: at a rejection (m < K) race over max(0, p_m - q_m), after K acceptances
    # (q = 0 there) over p_K, the bonus token. p_m's own race runs beside it with the same noise: its
    # winner is kept when the residual is all zero (p <= q everywhere, only by rounding).
    x_ptr = logits_ptr + (start + m) * logits_stride
    q_m = q_row + m * q_stride
    q_limit = tl.where(m < num_q, vocab, 0)  # entries of q_m to read
    point = tl.sum(tl.where(ks == m, drafts, 0), 0)  # a point mass's token ...
    point = tl.where((m < num_drafts) & (num_q == 0), point, -1)  # ... or -1: none
    best_r = tl.full([BLOCK], -1.0, tl.float32)
    best_p = tl.full([BLOCK], -1.0, tl.float32)
    index_r = tl.full([BLOCK], 2147483647, tl.int32)
    index_p = tl.full([BLOCK], 2147483647, tl.int32)
    residual_mass = tl.zeros([BLOCK], tl.float32)
    for col in range(0, tl.where(greedy, 0, vocab), BLOCK):  # NOTE: none for a greedy row (its token is known)
        cols = col + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(x_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(x / temperature - shift_m) / total_m
        q = tl.load(q_m + cols, mask=cols < q_limit, other=0.0).to(tl.float32)
        q = tl.where(cols == point, 1.0, q)
        r = tl.maximum(p - q, 0.0)
        residual_mass += r
        u = tl.maximum(tl.rand(seed, cols), 1.0e-30)  # NOTE: u = 0 would give E = inf: a lost race either way
        noise = -tl.log(u)  # E ~ Exponential(1), > 0 as u < 1
        score_r, score_p = r / noise, p / noise
        better_r = ok & (score_r > best_r)  # NaN scores never win
        better_p = ok & (score_p > best_p)
        best_r, index_r = tl.where(better_r, score_r, best_r), tl.where(better_r, cols, index_r)
        best_p, index_p = tl.where(better_p, score_p, best_p), tl.where(better_p, cols, index_p)
    token_r = tl.min(tl.where(best_r == tl.max(best_r, 0), index_r, 2147483647), 0)
    token_p = tl.min(tl.where(best_p == tl.max(best_p, 0), index_p, 2147483647), 0)
    token = tl.where(tl.sum(residual_mass, 0) > 0, token_r, token_p)
    token = tl.where(greedy, tl.sum(tl.where(ks == m, argmax, 0), 0), token)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + rows + row, tl.minimum(token, vocab - 1))


def verify(
    logits: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    temperatures: Sequence[float],
    seeds: torch.Tensor,
    draft_on_device: Sequence[DeviceTokens | None] | None = None,
    block: int = _VERIFY_BLOCK,
    stats_block: int | None = None,
) -> torch.Tensor:
    """Rejection sampling of rows of drafts against the target, one program a row -> [2 * rows] int32
    on the device: each row's accepted drafts m, then each row's last token.

    logits [sum of (K_i + 1), vocab] (any float dtype): row i's K_i + 1 positions in a run, divided
    by temperatures[i] (> 0; 0: a greedy row, see _verify_kernel). draft_token_ids[i]: K_i >= 1
    drafts; draft_probs[i]: [K_i, vocab] (any float dtype), the distributions they were drawn from,
    or None for point masses. seeds [rows]
    int64: each row's Philox stream. draft_on_device[i], when given: row i's drafts are on the device
    there (its draft_token_ids are placeholders of the same length), copied in on the device. block
    and stats_block (the second pass's and the first's vocabulary entries per iteration; by default
    the first's tile holds _VERIFY_TILE entries): powers of two; only the speed depends on them
    (tests make them small).
    """
    rows, vocab = len(draft_token_ids), logits.shape[1]
    device = logits.device
    counts = [len(drafts) for drafts in draft_token_ids]
    if logits.shape[0] != sum(counts) + rows:
        raise ValueError(
            f"logits must be [positions, vocab] with positions == {sum(counts) + rows} (K + 1 per row); "
            f"got shape {tuple(logits.shape)}"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    max_drafts = max(counts)
    starts = list(itertools.accumulate((k + 1 for k in counts[:-1]), initial=0))
    q_starts, q_parts, num_q = [-1] * rows, [], 0
    for i, probs in enumerate(draft_probs):
        if probs is not None:
            if probs.shape != (counts[i], vocab):
                raise ValueError(
                    f"draft_probs[{i}] must be [K, vocab] = [{counts[i]}, {vocab}]; got {tuple(probs.shape)}"
                )
            q_starts[i], num_q = num_q, num_q + counts[i]
            q_parts.append(probs)
    # NOTE: one row's draft_probs is used as it is (the batch-1 case): no copy. Without any, q is a
    # placeholder the kernel never reads.
    q = logits if not q_parts else (q_parts[0] if len(q_parts) == 1 else torch.cat(q_parts)).to(device)
    if q.stride(1) != 1:
        q = q.contiguous()
    temperature_bits = array("i", array("f", temperatures).tobytes())  # NOTE: the float32 bits, as int32
    drafts = itertools.chain.from_iterable([*d, *[0] * (max_drafts - len(d))] for d in draft_token_ids)
    host = upload([*starts, *counts, *q_starts, *temperature_bits, *drafts], torch.int32, device)
    if draft_on_device is not None and any(d is not None for d in draft_on_device):
        _patch_drafts(host, 4 * rows, max_drafts, draft_on_device)
    out = torch.empty(2 * rows, dtype=torch.int32, device=device)
    k_block = triton.next_power_of_2(max_drafts + 1)
    _verify_kernel[(rows,)](
        logits,
        logits.stride(0),
        q,
        q.stride(0),
        host,
        seeds,
        out,
        rows,
        max_drafts,
        vocab,
        K_BLOCK=k_block,
        STATS_BLOCK=stats_block or max(_VERIFY_TILE // k_block, 16),
        BLOCK=block,
        num_warps=_VERIFY_WARPS,
    )
    return out


def _patch_drafts(host: torch.Tensor, offset: int, max_drafts: int, on_device: Sequence[DeviceTokens | None]) -> None:
    """Copies the drafts on the device into the kernel's int32 inputs, whose [rows, max_drafts] draft
    table starts at `offset`: one gather and one scatter a source tensor (one in practice)."""
    by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, d in enumerate(on_device):
        if d is None:
            continue
        _, dst, src = by_tensor.setdefault(id(d.tokens), (d.tokens, [], []))
        dst.extend(range(offset + i * max_drafts, offset + i * max_drafts + len(d.index)))
        src.extend(d.index)
    for tokens, dst, src in by_tensor.values():
        index = upload(dst + src, torch.long, host.device)
        host.index_copy_(0, index[: len(dst)], tokens.index_select(0, index[len(dst) :]).to(torch.int32))
