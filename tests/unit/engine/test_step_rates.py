"""An engine's measured speed (engine/step_rates.py) with asynchronous scheduling: each launched
step is timed on the device (engine/step_timer.py), so neither a decode-only step's call that waited
for a prefill step nor the host's own work between calls (a prefill worker starting its pushes)
changes what a step reads. A fake device runs the steps one after another at known costs on its own
timeline, events fire in its stream order, and the host spends time between calls: the rates come
out exactly."""

from __future__ import annotations

from typing import Any

import pytest

from engine import SamplingParams
from engine.step_rates import StepRates

DECODE_S = 0.025  # a step with decoding rows, on the fake device
PROMPT_TOKENS_PER_S = 1_000.0  # and the prompt tokens it computes
HOST_GAP_S = 0.040  # what the host does between two step calls (delivering tokens, starting pushes)


class FakeDevice:
    """A stream: work starts when it is queued and the work before it is done; an event fires when the
    stream reaches it; the host's clock moves on its own work and when it waits for the stream."""

    def __init__(self) -> None:
        self.host_now = 0.0
        self.free_at = 0.0  # when the work queued so far is done
        self.last_out: Any = None  # the step being launched (the scheduler's output)
        self.done_at: dict[int, float] = {}  # a draw's end, by id of its pending sample

    def clock(self) -> float:
        return self.host_now

    def queue(self, seconds: float) -> None:
        self.free_at = max(self.host_now, self.free_at) + seconds

    def event(self) -> float:
        return max(self.host_now, self.free_at)

    def wait(self, until: float) -> None:
        self.host_now = max(self.host_now, until)


class FakeEventTimer:
    """engine.step_timer.CudaStepTimer on the fake device."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.pending: list[tuple[float, float, int, int]] = []

    def begin(self) -> object:
        return self.device.event()

    def end(self, mark: object, prompt_tokens: int, decode_rows: int) -> None:
        self.pending.append((float(mark), self.device.event(), prompt_tokens, decode_rows))  # type: ignore[arg-type]

    def collect(self, rates: StepRates) -> None:
        while self.pending and self.pending[0][1] <= self.device.host_now:
            start, end, prompt_tokens, decode_rows = self.pending.pop(0)
            rates.observe(end - start, prompt_tokens, decode_rows)


def test_async_steps_are_timed_on_the_device_whatever_the_host_does_between_calls(make_llm) -> None:
    llm = make_llm(async_scheduling=True, num_blocks=64, block_size=8, max_num_batched_tokens=32)
    engine, device = llm.engine, FakeDevice()
    schedule, execute, launch, finish = engine.scheduler.schedule, engine.runner.execute, engine.sampler.launch, \
        engine.sampler.finish

    def fake_schedule(*args: Any, **kwargs: Any) -> Any:
        device.last_out = schedule(*args, **kwargs)
        return device.last_out

    def fake_execute(*args: Any, **kwargs: Any) -> Any:
        out = device.last_out
        device.queue((DECODE_S if out.num_decode_rows else 0.0) + out.num_prompt_tokens / PROMPT_TOKENS_PER_S)
        return execute(*args, **kwargs)

    def fake_launch(*args: Any, **kwargs: Any) -> Any:
        pending = launch(*args, **kwargs)
        device.done_at[id(pending)] = device.free_at
        return pending

    def fake_finish(pending: Any) -> Any:
        device.wait(device.done_at.pop(id(pending)))
        return finish(pending)

    engine.clock, engine.step_timer = device.clock, FakeEventTimer(device)
    engine.scheduler.schedule, engine.runner.execute = fake_schedule, fake_execute
    engine.sampler.launch, engine.sampler.finish = fake_launch, fake_finish

    def step() -> None:
        engine.step()
        device.host_now += HOST_GAP_S

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("first", list(range(5, 55)), greedy)  # 50 tokens: a chunk that samples nothing, then one
    for _ in range(6):
        step()
    engine.add_request("long", list(range(100, 300)), greedy)  # 200 prompt tokens in chunks beside the decoding
    steps = 0
    while engine.has_unfinished():
        step()
        steps += 1
        assert steps < 200
    assert engine.rates.decode_step_s == pytest.approx(DECODE_S)
    assert engine.rates.prefill_tokens_per_s == pytest.approx(PROMPT_TOKENS_PER_S)
    assert engine.stats().num_prompt_tokens_computed == 50 + 200  # the autoscaler's prompt load counts these


def test_one_slow_step_does_not_hold_the_measured_speed_up() -> None:
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
    # the busy time counts every step, the slow ones too (the medians leave them out)
    assert rates.device_seconds == pytest.approx(3.0 + 2 * 0.008 + 5.0 + 0.2)
