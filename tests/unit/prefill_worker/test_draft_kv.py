"""A draft model's prompt KV computed on the prefill worker and shipped with the target's (when its
engine drafts with a model: prefill_worker/draft.py), in one process over the local transport.

The target serves as its own draft, so a greedy draft is accepted exactly when the draft's KV is
right: every draft accepted shows the shipped KV is the draft's own. Each request's prompt is
adopted by the decode worker's draft, whose first drafting step then feeds at most the two tokens
after it instead of the whole prompt. Offers the decode worker cannot take (another draft) or
that never come (a prefill worker without the draft) leave the prompt to the decode worker's draft;
a request whose first token ends it pushes nothing and leaves the pair in order. Tokens
always equal the offline engine's without speculation, and no block of either pool stays held."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams, SpeculativeConfig
from engine.llm import engine_config
from engine.spec.draft_loop import MAX_CATCH_UP
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
REMOTE = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(9, 60))] for _ in range(count)]


def _speculative(draft: Any) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=str(draft), num_draft_tokens=4)


class _DraftSpy:
    """Records the decode worker's draft: prompts adopted, and the most tokens one drafting step
    fed a request before drafting (its catch-up)."""

    def __init__(self, decode: DecodeWorker) -> None:
        proposer = decode.loop.engine.proposer
        self.adopted: list[str] = []
        self.catch_ups: list[int] = []
        adopt, plan = proposer.adopt_prompt, proposer._plan

        def adopting(request_id, prompt):
            blocks = adopt(request_id, prompt)
            if blocks is not None:
                self.adopted.append(request_id)
            return blocks

        def planning(requests, keep):
            jobs = plan(requests, keep)
            self.catch_ups += [j.num_new for j in jobs if j.is_drafting]
            return jobs

        proposer.adopt_prompt = adopting
        proposer._plan = planning


def _build(prefill_draft: Any, decode_draft: Any):
    """`prefill_draft` None: the prefill worker's engine does not draft (it ships no draft KV)."""
    hub = LocalHub()
    decode = DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine_config(**ENGINE, speculative=_speculative(decode_draft)),
                           transport="local"),
        transport_options={"hub": hub},
    )
    prefill = PrefillWorker(
        PrefillWorkerConfig(worker_id="p0", transport="local", engine=engine_config(
            **ENGINE, speculative=_speculative(prefill_draft) if prefill_draft is not None else SpeculativeConfig())),
        transport_options={"hub": hub},
    )
    return Workers.of(prefill={"p0": prefill}, decode={"d0": decode}), prefill, decode


async def _run(workers: Workers, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """One request at a time."""
    dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=REMOTE)
    tokens = []
    try:
        for i, prompt in enumerate(prompts):
            async def collect(rid: str = f"r{i}", prompt: list[int] = prompt) -> list[int]:
                return [t async for out in dispatcher.generate(rid, prompt, params) for t in out.new_token_ids]

            tokens.append(await asyncio.wait_for(collect(), 60))
    finally:
        await dispatcher.close()
    return tokens


async def _end(prefill: PrefillWorker, decode: DecodeWorker) -> None:
    assert [await prefill.check_integrity(), await decode.check_integrity()] == [0, 0]
    await prefill.shutdown()
    await decode.shutdown()


def test_shipped_draft_kv_is_adopted_and_right():
    prompts = _prompts(5)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def main():
        workers, prefill, decode = _build("default", "default")
        assert prefill.draft is not None and prefill.loop.engine.proposer is None  # it never drafts
        spy = _DraftSpy(decode)
        assert await _run(workers, prompts, GREEDY) == offline
        assert spy.adopted == [f"r{i}" for i in range(len(prompts))]
        assert (await decode.stats()).num_draft_kv_adopted == len(prompts)
        assert spy.catch_ups and max(spy.catch_ups) <= MAX_CATCH_UP  # no prompt computed by the decode's draft
        stats = decode.loop.engine.stats()
        assert stats.num_spec_draft_tokens > 0
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens  # the shipped KV is the draft's own
        await _end(prefill, decode)

    asyncio.run(main())


@pytest.mark.parametrize("why", ["no draft on the prefill worker", "another draft"])
def test_prompt_left_to_the_decode_workers_draft(why, hf_checkpoints):
    prompts = _prompts(3, seed=1)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def main():
        prefill_draft = hf_checkpoints("llama") if why == "another draft" else None
        workers, prefill, decode = _build(prefill_draft, "default")
        if why == "another draft":
            assert prefill.draft is not None
            assert prefill.draft.offer.fingerprint != decode.draft_fingerprint
        else:
            assert prefill.draft is None
        spy = _DraftSpy(decode)
        assert await _run(workers, prompts, GREEDY) == offline
        assert spy.adopted == []
        assert max(spy.catch_ups) > MAX_CATCH_UP  # the decode worker's draft computed the prompts
        stats = decode.loop.engine.stats()
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens > 0
        await _end(prefill, decode)

    asyncio.run(main())


def test_first_token_that_ends_the_request_pushes_nothing_and_keeps_the_pair():
    async def main():
        workers, prefill, decode = _build("default", "default")
        spy = _DraftSpy(decode)
        ended = await _run(workers, _prompts(2, seed=2), SamplingParams(max_tokens=1, temperature=0.0))
        assert [len(t) for t in ended] == [1, 1] and spy.adopted == []
        assert [await prefill.check_integrity(), await decode.check_integrity()] == [0, 0]
        # The pair is still in order: the next request's KV and draft KV land right.
        prompt = _prompts(1, seed=3)[0]
        want = LLM(**ENGINE).generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert await _run(workers, [prompt], GREEDY) == [want]
        assert spy.adopted == ["r0"]
        stats = decode.loop.engine.stats()
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens > 0
        await _end(prefill, decode)

    asyncio.run(main())
