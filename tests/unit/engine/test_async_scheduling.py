"""Asynchronous scheduling (engine/engine.py): a step queued before the previous step's tokens are
read gives, request for request, the tokens and finish reasons of the synchronous order (greedy and
seeded rows), through token stops that end requests already queued for one more step, length
stops, preemption, chunked prefill, a full waiting queue, aborts between steps and penalties (which
read the previous tokens first). The CPU runs the same code as CUDA, only without the overlap."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams, SpeculativeConfig
from engine.runner import TokenPatch

ENGINE = {"num_blocks": 24, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 24}


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    params = []
    for i in range(10):
        if i % 3 == 2:  # seeded sampling: the tokens depend on (seed, position) alone
            params.append(SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.9, seed=i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True))
    return prompts, params


def _run(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


@pytest.fixture
def counted_patches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many placeholder inputs each TokenPatch fixed on the device."""
    sizes: list[int] = []
    apply = TokenPatch.apply

    def counting(self: TokenPatch, ids) -> None:  # type: ignore[no-untyped-def]
        sizes.append(len(self.dst))
        apply(self, ids)

    monkeypatch.setattr(TokenPatch, "apply", counting)
    return sizes


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_async_gives_the_sync_tokens_through_stops_and_preemption(make_llm, one_torch_thread, counted_patches,
                                                                 prefix_caching):
    prompts, params = _workload(0)
    sync = make_llm(async_scheduling=False, enable_prefix_caching=prefix_caching, **ENGINE)
    want = _run(sync, prompts, params)
    # Token stops chosen from the synchronous run, so requests stop on a token mid-way (not by length).
    stopped = []
    for (tokens, _), p in zip(want, params):
        k = len(tokens) // 2
        stop = [tokens[k]] if p.is_greedy and len(tokens) > 2 and tokens[k] not in tokens[:k] else []
        stopped.append(p.model_copy(update={"stop_token_ids": stop}))
    want = _run(sync, prompts, stopped)
    assert any(reason == "stop" for _, reason in want), "the workload should stop some requests on a token"
    assert sync.engine.stats().num_preemptions > 0, "the cache should force preemptions"

    llm = make_llm(async_scheduling=True, enable_prefix_caching=prefix_caching, **ENGINE)
    assert llm.engine.async_scheduling
    got = _run(llm, prompts, stopped)
    assert got == want
    assert llm.engine.stats().num_preemptions > 0
    assert counted_patches and max(counted_patches) > 1, "decode steps should take their inputs from the device"


def test_async_abort_between_steps_leaves_the_others_unchanged(make_llm, one_torch_thread):
    prompts, params = _workload(1)
    want = _run(make_llm(async_scheduling=False, **ENGINE), prompts, params)
    llm = make_llm(async_scheduling=True, **ENGINE)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    aborted = {"0", "4"}
    for step in range(500):
        if not engine.has_unfinished():
            break
        if step == 3:
            for rid in aborted:
                engine.abort_request(rid)  # in flight: its queued draw is dropped
        for out in engine.step():
            assert out.request_id not in aborted or step < 3 + 1, "an aborted request reported a token later"
            tokens[out.request_id].extend(out.new_token_ids)
    else:
        raise AssertionError("the engine did not drain in 500 steps")
    for i, (w, _) in enumerate(want):
        if str(i) not in aborted:
            assert tokens[str(i)] == w, f"request {i}"


def test_async_with_penalties_reads_the_tokens_first(make_llm, one_torch_thread, counted_patches):
    """A penalty needs the last tokens on the host: the asynchronous engine reads each step's tokens
    before queueing the next, so no placeholder is ever patched on the device, and the tokens are the
    synchronous engine's."""
    prompts, _ = _workload(2)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5 * (i % 2)) for i in range(len(prompts))]
    want = _run(make_llm(async_scheduling=False, **ENGINE), prompts, params)
    llm = make_llm(async_scheduling=True, **ENGINE)
    assert llm.engine.async_scheduling
    assert _run(llm, prompts, params) == want
    assert counted_patches == []


def test_speculation_drafts_in_small_batches_and_steps_asynchronously_in_large_ones(make_llm, one_torch_thread):
    """With a proposer and disable_above_batch_size=2: while more than two requests run, steps are
    queued asynchronously (no drafting); as the batch shrinks, the step in flight is read and the
    rest draft and verify. Greedy and seeded tokens stay those of the synchronous engine without
    speculation."""
    prompts, params = _workload(3)
    want = _run(make_llm(async_scheduling=False, **ENGINE), prompts, params)
    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=3, disable_above_batch_size=2)
    llm = make_llm(async_scheduling=True, speculative=spec, **ENGINE)
    engine = llm.engine
    assert engine.async_scheduling
    step_async, batches = engine._step_async, []

    def spying():  # type: ignore[no-untyped-def]
        batches.append(len(engine.scheduler.running))
        return step_async()

    engine._step_async = spying  # type: ignore[method-assign]
    assert _run(llm, prompts, params) == want
    assert batches and max(batches) > 2, "steps with more than two requests running should be queued asynchronously"
    stats = llm.engine.stats()
    assert stats.num_spec_verifications > 0 and stats.num_spec_accepted_tokens > 0
