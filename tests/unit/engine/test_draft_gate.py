"""The draft gate (engine/spec/gate.py): per bucket of batch sizes it drafts, probes plain decoding,
keeps the faster kind by measured rates, backs off its probes while they confirm it and starts again
when one overturns it; a step of the kind just switched from is not measured. Then through an
engine whose clock makes drafting slow, or fast: it stops drafting, or keeps at it, and its output is
the same either way (greedy)."""

from __future__ import annotations

import pytest

from engine import SamplingParams, SpeculativeConfig
from engine.spec.gate import FIRST_HOLD, HOLD, MAX_HOLD, PROBE, DraftGate


def _run(gate: DraftGate, batch: int, steps: int, draft_rate: float, plain_rate: float) -> list[bool]:
    """Steps of the kinds the gate asks for, each measured at its kind's rate (tokens a second, 1 s a step)."""
    kinds = []
    for _ in range(steps):
        drafts = gate.drafts(batch)
        kinds.append(drafts)
        gate.observe(batch, drafts, 1.0, round(draft_rate if drafts else plain_rate))
    return kinds


def _phases(kinds: list[bool]) -> list[tuple[bool, int]]:
    """Runs of one kind: (kind, length)."""
    runs: list[tuple[bool, int]] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    return runs


def test_a_draft_that_pays_is_kept_and_probed_ever_more_rarely() -> None:
    gate = DraftGate()
    kinds = _run(gate, 1, 2000, draft_rate=30, plain_rate=10)
    # NOTE: a switch's first step is not measured, so each phase is one step longer than its count
    runs = _phases(kinds)
    assert runs[:4] == [(True, FIRST_HOLD), (False, PROBE + 1), (True, 2 * HOLD + 1), (False, PROBE + 1)]
    holds = [n - 1 for kind, n in runs[2:-1] if kind]  # every hold ended by a probe
    assert len(holds) >= 4 and holds == [min(HOLD << i, MAX_HOLD) for i in range(1, len(holds) + 1)]
    assert gate.num_overturns == 0
    assert sum(not k for k in kinds) <= 5 * (PROBE + 1)  # a few probes in 2,000 steps
    assert gate.rates(1) == (30.0, 10.0)


def test_a_draft_that_loses_is_dropped_and_probed_ever_more_rarely() -> None:
    gate = DraftGate()
    kinds = _run(gate, 32, 2000, draft_rate=10, plain_rate=30)
    runs = _phases(kinds)
    assert runs[:3] == [(True, FIRST_HOLD), (False, PROBE + 1 + HOLD), (True, PROBE + 1)]
    assert gate.num_overturns == 1
    assert sum(kinds) <= FIRST_HOLD + 5 * (PROBE + 1)
    assert gate.rates(32) == (10 / 32, 30 / 32)  # a request's


def test_a_probe_that_overturns_the_kind_starts_the_holds_again() -> None:
    gate = DraftGate()
    _run(gate, 4, FIRST_HOLD + PROBE + 1 + HOLD, draft_rate=30, plain_rate=10)  # drafting held, for 2 HOLD
    assert gate.drafts(4) and gate.num_overturns == 0
    # The text turns: drafts are rejected from here on. The next probe finds plain decoding faster once the
    # drafting window is mostly slow steps.
    kinds = _run(gate, 4, 4000, draft_rate=5, plain_rate=10)
    assert gate.num_overturns == 1 and not gate.drafts(4)
    assert kinds[-100:].count(True) <= PROBE + 1


def test_buckets_by_batch_size_are_apart() -> None:
    gate = DraftGate()
    _run(gate, 32, FIRST_HOLD + PROBE + 1, draft_rate=10, plain_rate=30)
    assert not gate.drafts(32) and not gate.drafts(63)  # one bucket: 32-63
    assert gate.drafts(1) and gate.drafts(16) and gate.drafts(64)
    assert gate.rates(16) == (None, None)


def test_rates_are_a_requests_so_batch_sizes_within_a_bucket_compare() -> None:
    """A launch-bound step (its time the same at 16 and 30 requests): drafting 2 s a step for 1.5 tokens a
    request, plain decoding 0.8 s for 1. Drafting measured at 30 requests and the plain probe at 16 (a
    batch that shrinks as requests finish): plain decoding is faster at either size, and the gate says
    so; by the whole batch's tokens a second (45 / 2 against 16 / 0.8) it would keep drafting."""
    gate = DraftGate()
    for _ in range(FIRST_HOLD):
        gate.observe(30, True, 2.0, 45)
    assert not gate.drafts(30)  # the probe
    gate.observe(16, False, 0.8, 0)  # the first step after the switch: not measured
    for _ in range(PROBE):
        gate.observe(16, False, 0.8, 16)
    assert not gate.drafts(16) and gate.num_overturns == 1
    assert gate.rates(16) == (pytest.approx(0.75), pytest.approx(1.25))


def test_steps_of_a_kind_not_asked_for_and_empty_steps_are_not_measured() -> None:
    gate = DraftGate()
    for _ in range(3 * FIRST_HOLD):  # steps that did not draft, where the bucket asked for drafting (a cap)
        gate.observe(8, False, 1.0, 8)
    assert gate.rates(8) == (None, None) and gate.drafts(8)
    gate.observe(8, True, 1.0, 0)  # the first call after a switch (nothing read), then one of no time
    gate.observe(8, True, 0.0, 5)
    gate.observe(8, True, 1.0, 5)
    assert gate.rates(8) == (5 / 8, None)  # tokens a second a request
    # A step past the cap, not measured, still counts as the kind it was: the drafting step after it is the
    # first after a switch.
    gate.unmeasured(drafted=False)
    gate.observe(8, True, 1.0, 100)
    gate.observe(8, True, 1.0, 9)
    assert gate.rates(8) == (7 / 8, None)  # the median of 5 and 9: the step of 100 was not measured


@pytest.mark.parametrize("draft_cost_s", [0.5, 0.0])
def test_an_engine_stops_drafting_when_its_clock_says_drafting_is_slow(make_llm, draft_cost_s) -> None:
    """An engine whose clock jumps by draft_cost_s at every proposal (a slow drafter) decodes plainly
    after its first probe, where one whose proposals cost nothing (the target as its own draft:
    every draft accepted) keeps drafting; the greedy tokens are plain decoding's either way."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 300, 17]]
    plain = [o.outputs[0].token_ids for o in make_llm(block_size=4).generate(prompts, params)]
    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=2,
                             enable_adaptive_draft_length=False)
    llm = make_llm(block_size=4, speculative=spec)
    llm.engine.clock = clock  # NOTE: what the gate times a step by
    propose = llm.engine.proposer.propose

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        now[0] += draft_cost_s
        return propose(*args, **kwargs)

    llm.engine.proposer.propose = slow
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.engine.stats()
    gate = llm.engine.draft_gate
    drafted, undrafted = gate.rates(1)
    assert drafted is not None and undrafted is not None
    if draft_cost_s:
        assert stats.num_spec_gate_overturns == 1 and not gate.drafts(1) and drafted < undrafted
    else:
        assert stats.num_spec_gate_overturns == 0 and gate.drafts(1) and drafted > undrafted
