"""Prompts that skip the prefill workers, in one process without Ray: a short prompt, or one a decode
worker mostly holds in its prefix cache, is computed by the decode worker itself (no lease, no
prefill call); a long fresh one goes through the prefill worker; a decode worker whose cache no
longer holds what the router believes declines, and the prompt goes through the prefill worker.
Greedy tokens equal the offline engine's and no worker holds a block afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from engine.validation import InvalidRequestError
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, DispatcherConfig, LocalPrefillConfig, Workers
from tests.spy import Spy

ENGINE = {"device": "cpu", "block_size": 8, "num_blocks": 256}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SHORT = 32  # max_short_prompt_tokens of these tests
CONFIG = DispatcherConfig(local_prefill=LocalPrefillConfig(max_short_prompt_tokens=SHORT, min_cached_fraction=0.75))


def _build(num_decode: int = 1) -> tuple[dict[str, Spy], dict[str, Spy]]:
    hub = LocalHub()
    engine = engine_config(**ENGINE)
    prefill = {"p0": Spy(PrefillWorker(PrefillWorkerConfig(worker_id="p0", engine=engine, transport="local"),
                                       transport_options={"hub": hub}))}
    decode = {f"d{i}": Spy(DecodeWorker(DecodeWorkerConfig(worker_id=f"d{i}", engine=engine, transport="local"),
                                        transport_options={"hub": hub})) for i in range(num_decode)}
    return prefill, decode


def _random_prompt(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(4, 2048) for _ in range(rng.randrange(low, high))]


async def _generate(dispatcher: Dispatcher, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """The tokens and the num_cached_tokens the client sees."""
    tokens: list[int] = []
    num_cached = 0
    async for out in dispatcher.generate(rid, prompt, GREEDY):
        tokens += out.new_token_ids
        num_cached = out.num_cached_tokens
    return tokens, num_cached


async def _held_and_shutdown(*groups: dict[str, Spy]) -> list[int]:
    workers = [s.worker for group in groups for s in group.values()]
    held = [await w.check_integrity() for w in workers]
    for w in workers:
        await w.shutdown()
    return held


def test_short_prompts_skip_the_prefill_worker_and_long_ones_do_not():
    rng = random.Random(0)
    short = [_random_prompt(rng, 3, SHORT) for _ in range(6)]
    long = [_random_prompt(rng, SHORT, 90) for _ in range(4)]
    prompts = short + long
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def main():
        prefill, decode = _build()
        dispatcher = Dispatcher("r0", Workers.of(prefill=prefill, decode=decode), poll_timeout_s=0.2, config=CONFIG)
        results = await asyncio.wait_for(
            asyncio.gather(*(_generate(dispatcher, f"req-{i}", p) for i, p in enumerate(prompts))), 120
        )
        await dispatcher.close()
        short_ids = {f"req-{i}" for i in range(len(short))}
        long_ids = {f"req-{i}" for i in range(len(short), len(prompts))}
        assert set(decode["d0"].calls["prefill_locally"]) == short_ids
        assert set(prefill["p0"].calls["prefill"]) == long_ids  # the short ones never reached it
        assert set(decode["d0"].calls["reserve"]) == long_ids  # nor took a lease
        assert dispatcher.num_local_prefills == len(short)
        assert await _held_and_shutdown(prefill, decode) == [0, 0]
        return [tokens for tokens, _ in results]

    assert asyncio.run(main()) == offline


def test_a_prompt_its_decode_worker_mostly_holds_skips_the_prefill_worker_unless_it_no_longer_does():
    rng = random.Random(1)
    first = _random_prompt(rng, 80, 81)
    fresh = _random_prompt(rng, 100, 101)
    llm = LLM(**ENGINE)
    answer = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    # the next turn of a conversation: the first prompt, its answer, and a new question
    follow_up = first + answer + _random_prompt(rng, 8, 9)
    offline = [o.outputs[0].token_ids for o in llm.generate([follow_up, fresh, follow_up], GREEDY)]

    async def main():
        prefill, decode = _build(num_decode=2)
        dispatcher = Dispatcher("r0", Workers.of(prefill=prefill, decode=decode), poll_timeout_s=0.2, config=CONFIG)
        assert (await _generate(dispatcher, "first", first))[0] == answer
        (holder,) = [i for i, d in decode.items() if d.calls["reserve"] == ["first"]]
        # 91 of the follow-up's 100 tokens have KV on `holder`: it computes the 9 others itself
        tokens, num_cached = await _generate(dispatcher, "follow-up", follow_up)
        assert tokens == offline[0] and num_cached == 88  # 11 full blocks of 8
        assert decode[holder].calls["prefill_locally"] == ["follow-up"]
        assert prefill["p0"].calls["prefill"] == ["first"]
        # a long prompt no decode worker holds goes through the prefill worker
        assert (await _generate(dispatcher, "fresh", fresh))[0] == offline[1]
        assert prefill["p0"].calls["prefill"] == ["first", "fresh"]
        # the holder's cache is emptied behind the router's back: it declines, the prefill worker computes it
        await decode[holder].worker._call(lambda e: e.pool.reset_prefix_cache())
        tokens, _ = await _generate(dispatcher, "again", follow_up)
        assert tokens == offline[2]
        assert decode[holder].calls["prefill_locally"] == ["follow-up", "again"]
        assert prefill["p0"].calls["prefill"] == ["first", "fresh", "again"]
        assert dispatcher.num_local_prefills == 1
        await dispatcher.close()
        assert await _held_and_shutdown(prefill, decode) == [0, 0, 0]

    asyncio.run(main())


def test_bad_input_in_a_short_prompt_is_the_client_s_error():
    async def main():
        prefill, decode = _build()
        dispatcher = Dispatcher("r0", Workers.of(prefill=prefill, decode=decode), poll_timeout_s=0.2, config=CONFIG)
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await _generate(dispatcher, "bad", [5, 6, 99_999])
        assert decode["d0"].calls["prefill_locally"] == ["bad"] and not prefill["p0"].calls["prefill"]
        await dispatcher.close()
        assert await _held_and_shutdown(prefill, decode) == [0, 0]

    asyncio.run(main())
