"""An engine's measured speed (engine/step_rates.py) with asynchronous scheduling: each step call is
timed against the work it waited for (the steps launched before it), so a decode-only step's call
that waited for a prefill step does not read as a slow decode step. A fake device runs the steps
one after another at known costs and the host costs nothing: the rates come out exactly."""

from __future__ import annotations

from typing import Any

import pytest

from engine import SamplingParams

DECODE_S = 0.025  # a step with decoding rows, on the fake device
PROMPT_TOKENS_PER_S = 1_000.0  # and the prompt tokens it computes


class FakeDevice:
    """Steps queue in launch order; reading a step's tokens runs every queued step up to it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queue: list[tuple[Any, float]] = []  # (the step's pending draw or None, its seconds)

    def clock(self) -> float:
        return self.now

    def launched(self, pending: Any, prompt_tokens: int, decode_rows: int) -> None:
        self.queue.append((pending, (DECODE_S if decode_rows else 0.0) + prompt_tokens / PROMPT_TOKENS_PER_S))

    def wait_for(self, pending: Any) -> None:
        while self.queue:
            done, seconds = self.queue.pop(0)
            self.now += seconds
            if done is pending:
                return


def test_async_steps_are_timed_against_the_steps_they_waited_for(make_llm) -> None:
    llm = make_llm(async_scheduling=True, num_blocks=64, block_size=8, max_num_batched_tokens=32)
    engine, device = llm.engine, FakeDevice()
    book, finish = engine._book, engine.sampler.finish

    def fake_book(out: Any, sampling: Any, pending: Any) -> Any:
        device.launched(pending, out.num_prompt_tokens, out.num_decode_rows)
        return book(out, sampling, pending)

    def fake_finish(pending: Any) -> Any:
        device.wait_for(pending)
        return finish(pending)

    engine.clock, engine._book, engine.sampler.finish = device.clock, fake_book, fake_finish
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("first", list(range(5, 55)), greedy)  # 50 tokens: a chunk that samples nothing, then one
    for _ in range(6):
        engine.step()
    engine.add_request("long", list(range(100, 300)), greedy)  # 200 prompt tokens in chunks beside the decoding
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 200
    assert engine.rates.decode_step_s == pytest.approx(DECODE_S)
    assert engine.rates.prefill_tokens_per_s == pytest.approx(PROMPT_TOKENS_PER_S)


def test_one_slow_step_does_not_hold_the_measured_speed_up() -> None:
    from engine.step_rates import StepRates

    rates = StepRates(window=16)
    rates.observe(3.0, 0, 16)  # a first decode step that waited for a first NCCL transfer, say
    for _ in range(2):
        rates.observe(0.008, 0, 16)
    # a running mean of weight 0.1 would read 2.43 s here, and above 0.136 s for 27 more decode steps
    assert rates.decode_step_s == pytest.approx(0.008)
    rates.observe(5.0, 4_000, 0)  # and one slow prefill step among quick ones
    rates.observe(0.1, 4_000, 0)
    rates.observe(0.1, 4_000, 0)
    assert rates.prefill_tokens_per_s == pytest.approx(40_000)
