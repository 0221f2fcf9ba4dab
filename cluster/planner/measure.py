"""Measures a StepProfile on the engine at hand: a prefill step's time by prompt length, and a
decode step's by batch and context. Random prompt tokens; each figure the median of `repeats`
timed steps after a warm-up; the engine steps synchronously (a step reads its own sampled tokens, so
its wall time is the whole step's). A profile measured with asynchronous steps (the CUDA default) timed
the launches: on 2x H200 it predicted 89.5 req/s of 1P1D goodput where 12 was measured."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

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


def decode_ms(engine: EngineCore, batch: int, context: int, repeats: int, rng: random.Random) -> float:
    """A decode step of `batch` sequences of about `context` tokens each."""
    vocab = engine.arch.vocab_size
    params = SamplingParams(max_tokens=repeats + 8, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"profile-decode-{batch}-{context}-{b}", _prompt(rng, context, vocab), params)
    steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # the prompts
        steps += 1
        if steps > 10_000:
            raise RuntimeError("the profile's prompts did not finish prefilling")
    engine.step()  # warm-up
    times = [_timed_step(engine) for _ in range(repeats)]
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def measure(engine: EngineCore, prefill_tokens: Sequence[int], decode_batches: Sequence[int],
            decode_contexts: Sequence[int], repeats: int = 3, seed: int = 0) -> StepProfile:
    """The engine's StepProfile over the grids. The KV cache must hold max(batch) x max(context).
    The engine must step synchronously (async_scheduling=False): an asynchronous step() returns once the
    next step is queued on the device, so its wall time is not the step's."""
    if engine.async_scheduling:
        raise ValueError("profile an engine built with async_scheduling=False: an asynchronous step() returns "
                         "before the device has run it, so its time is not the step's")
    budget = engine.config.scheduler.max_num_batched_tokens
    longest = min(budget, engine.max_seq_tokens - 1)
    too_long = [n for n in prefill_tokens if n > longest]
    if too_long:
        raise ValueError(f"prefill lengths {too_long} exceed {longest} tokens (one step's budget, and the longest "
                         "prompt the engine takes)")
    if max(decode_contexts) + repeats + 16 > engine.max_seq_tokens:
        raise ValueError(f"decode context {max(decode_contexts)} leaves no room to decode within "
                         f"{engine.max_seq_tokens} tokens")
    need = max(decode_batches) * (max(decode_contexts) + repeats + 16)
    if need > engine.capacity_tokens:
        raise ValueError(f"the decode grid needs {need} KV tokens; the cache holds {engine.capacity_tokens}")
    rng = random.Random(seed)
    prefill = [prefill_ms(engine, n, repeats, rng) for n in prefill_tokens]
    decode = [[decode_ms(engine, b, c, repeats, rng) for c in decode_contexts] for b in decode_batches]
    scheduler = engine.config.scheduler
    return StepProfile(
        prefill_tokens=tuple(prefill_tokens), prefill_ms=tuple(prefill), decode_batches=tuple(decode_batches),
        decode_contexts=tuple(decode_contexts), decode_ms=tuple(tuple(row) for row in decode),
        max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
    )
