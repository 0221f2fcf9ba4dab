"""Measures a StepProfile on the engine at hand: a prefill step's time by prompt length, and a
decode step's by batch and context. Random prompt tokens; each figure the median of `repeats`
timed steps after a warm-up. A prefill figure's step runs synchronously (it reads its own sampled
tokens, so its wall time is the whole step's: one step timed alone after idling, asynchronously, would
time its launch; so measured, a profile on 2x H200 predicted 89.5 req/s of 1P1D goodput where 12 was
measured). A decode figure times a run of asynchronous steps, as served: each call reads the step before
and queues the next, so it takes the longer of the host's and the device's work (at the 70B shape on 4x
H200 the served decode workers' device steps read 1-2 ms under the synchronous steps' wall time). A decode
figure's sequences join as a disaggregated decode worker's do, their prompts' KV taken as already in
their blocks (EngineCore.reserve and add_prefilled; a decode step reads it whatever it holds), so the
whole batch decodes from its first step and no prompt is computed (prefilling every point's prompts
took 564k prompt tokens at the 70B shape's grid). A decode figure is the median of `decode_repeats` steps
(cheap: a step is milliseconds), and the grid is made monotone after: a point with more sequences or a
longer context that read faster than a smaller one takes the smaller one's time, and the report says so
(the 8B profile on 2x H200, three steps a figure, had 32 x 4096 at 5.99 ms under 8 x 4096's 6.66 and under
the step's bandwidth floor, about 6.8 ms). Each figure is reported as it is measured: at the
70B shape on 4x H200 a TP=2 grid took 3 s after the engine's start (pdserve plan then waited in the
engine's close: TPGroup.shutdown now runs on every rank at once; not yet re-run on a GPU)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

from cluster.planner.profile import StepProfile
from engine.config import SamplingParams
from engine.engine import EngineCore


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def _timed_step(engine: EngineCore) -> float:
    started = time.perf_counter()
    engine.step()
    return (time.perf_counter() - started) * 1e3


def prefill_ms(engine: EngineCore, length: int, repeats: int, rng: random.Random) -> float:
    """One prompt of `length` tokens computed alone (it must fit one step's token budget)."""
    vocab = engine.arch.vocab_size
    times = []
    for r in range(repeats + 1):
        rid = f"profile-prefill-{length}-{r}"
        engine.add_request(rid, _prompt(rng, length, vocab), SamplingParams(max_tokens=1, temperature=0.0))
        step = _timed_step(engine)
        while engine.has_unfinished():
            engine.step()
        if r:  # NOTE: the first is a warm-up
            times.append(step)
    return statistics.median(times)


def decode_tokens(repeats: int) -> int:
    """The tokens each request of a decode figure asks for: more than the warm-up and the timed steps,
    or the timing would see a smaller batch."""
    return repeats + 8


def decode_fits(engine: EngineCore, batch: int, context: int, repeats: int) -> bool:
    """Whether the engine holds a decode figure of `batch` sequences of `context` tokens and their decoding."""
    tokens = context + decode_tokens(repeats)
    return tokens <= engine.max_seq_tokens and batch * tokens <= engine.capacity_tokens and (
        batch <= engine.config.scheduler.max_num_seqs)


def decode_ms(engine: EngineCore, batch: int, context: int, repeats: int, rng: random.Random) -> float:
    """A decode step of `batch` sequences of `context` tokens each, as a served engine steps: asynchronously,
    the host's work for one step beside the device's for the one before, so each call in a run of them
    takes the longer of the two (a synchronous step's wall time is their sum)."""
    vocab = engine.arch.vocab_size
    params = SamplingParams(max_tokens=decode_tokens(repeats), temperature=0.0, ignore_eos=True)
    num_blocks = -(-context // engine.pool.block_size)
    for b in range(batch):
        rid = f"profile-decode-{batch}-{context}-{b}"
        if engine.reserve(rid, num_blocks) is None:
            raise RuntimeError(f"the cache holds fewer than {batch} sequences of {context} tokens")
        engine.add_prefilled(rid, _prompt(rng, context, vocab), rng.randrange(vocab), params, lease_key=rid)
    engine.step()  # warm-up
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"the decode profile would time {len(engine.scheduler.running)} running sequences, "
                           f"not {batch}: the cache or max_num_seqs holds fewer")
    engine.async_scheduling = True
    try:
        engine.step()  # NOTE: returns once the next step is queued; each later call reads one step, queues one
        times = [_timed_step(engine) for _ in range(repeats)]
        while engine.has_unfinished():  # NOTE: to their last token (its length ends them): no step left in flight
            engine.step()
    finally:
        engine.async_scheduling = False
    return statistics.median(times)


def monotone(decode: list[list[float]], batches: Sequence[int], contexts: Sequence[int],
             report: Callable[[str], None] = lambda line: None) -> list[list[float]]:
    """The decode grid with each point at least the time of every point with no more sequences and no longer
    contexts (a step with more work is never faster); each point raised is reported with its measured time."""
    out = [list(row) for row in decode]
    for i, b in enumerate(batches):
        for j, c in enumerate(contexts):
            below = max(([out[i - 1][j]] if i else []) + ([out[i][j - 1]] if j else []), default=0.0)
            if out[i][j] < below:
                report(f"decode of {b} x {c} tokens: {out[i][j]:.2f} ms measured, under a smaller point's "
                       f"{below:.2f}: taken as {below:.2f}")
                out[i][j] = below
    return out


def measure(engine: EngineCore, prefill_tokens: Sequence[int], decode_batches: Sequence[int],
            decode_contexts: Sequence[int], repeats: int = 3, seed: int = 0,
            report: Callable[[str], None] = lambda line: None, decode_repeats: int | None = None) -> StepProfile:
    """The engine's StepProfile over the grids. The KV cache must hold max(batch) x max(context).
    repeats: timed prefill steps a figure; decode_repeats (default `repeats`): timed decode steps a figure.
    The engine must be built to step synchronously (async_scheduling=False; a decode figure switches it
    to asynchronous steps and back): an asynchronous prefill step() returns once the step is queued on the
    device, so its wall time is not the step's. REPORT gets a line per figure."""
    if engine.async_scheduling:
        raise ValueError("profile an engine built with async_scheduling=False: an asynchronous step() returns "
                         "before the device has run it, so its time is not the step's")
    budget = engine.config.scheduler.max_num_batched_tokens
    longest = min(budget, engine.max_seq_tokens - 1)
    too_long = [n for n in prefill_tokens if n > longest]
    if too_long:
        raise ValueError(f"prefill lengths {too_long} exceed {longest} tokens (one step's budget, and the longest "
                         "prompt the engine takes)")
    decode_repeats = repeats if decode_repeats is None else decode_repeats
    batch, context = max(decode_batches), max(decode_contexts)
    if not decode_fits(engine, batch, context, decode_repeats):
        need = context + decode_tokens(decode_repeats)
        raise ValueError(f"the decode grid's largest point ({batch} sequences of {context} tokens, each decoding to "
                         f"{need}) needs {batch * need} KV tokens, {need} a sequence, {batch} sequences; the engine "
                         f"holds {engine.capacity_tokens}, {engine.max_seq_tokens} a sequence, "
                         f"{engine.config.scheduler.max_num_seqs} sequences")
    rng = random.Random(seed)
    started = time.monotonic()
    prefill = []
    for n in prefill_tokens:
        prefill.append(prefill_ms(engine, n, repeats, rng))
        report(f"prefill of {n} tokens: {prefill[-1]:.1f} ms ({time.monotonic() - started:.0f} s in)")
    decode = []
    for b in decode_batches:
        decode.append([])
        for c in decode_contexts:
            decode[-1].append(decode_ms(engine, b, c, decode_repeats, rng))
            report(f"decode of {b} x {c} tokens: {decode[-1][-1]:.1f} ms ({time.monotonic() - started:.0f} s in)")
    decode = monotone(decode, decode_batches, decode_contexts, report)
    scheduler = engine.config.scheduler
    return StepProfile(
        prefill_tokens=tuple(prefill_tokens), prefill_ms=tuple(prefill), decode_batches=tuple(decode_batches),
        decode_contexts=tuple(decode_contexts), decode_ms=tuple(tuple(row) for row in decode),
        max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
    )
