"""How long each launched step takes on the device, for StepRates (engine/step_rates.py).

A step's time runs from when the device could start it (its launch, or the end of the work queued
before it) to its end. On CUDA two events recorded on the current stream around the step's launch
give exactly that: in stream order the first fires when the work before it is done. Elsewhere the
work runs as it is launched, so the host's wall time around the launch is the step's time.

Timing the host's step calls instead (the wall time of a call that waits for the step before it)
misses the device work that overlaps whatever the host does between calls: a prefill worker starting
its pushes, a decode worker handing tokens to its routers. Such a step reads shorter than it is,
and its prompt tokens a second higher.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from engine.step_rates import StepRates

__all__ = ["StepTimer", "WallStepTimer", "CudaStepTimer", "step_timer_for"]


class StepTimer(Protocol):
    def begin(self) -> object:
        """Before a step's work is launched: its mark."""
        ...

    def end(self, mark: object, prompt_tokens: int, decode_rows: int) -> None:
        """After its work is launched (the host need not wait for it)."""
        ...

    def collect(self, rates: StepRates) -> None:
        """Observes into `rates` every ended step whose time is known by now, in launch order; never waits."""
        ...


class WallStepTimer:
    """The host's wall time around a launch: a device that runs each operation as it is called (CPU)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._ended: deque[tuple[float, int, int]] = deque(maxlen=256)

    def begin(self) -> object:
        return float(self.clock())

    def end(self, mark: object, prompt_tokens: int, decode_rows: int) -> None:
        assert isinstance(mark, float)
        self._ended.append((float(self.clock()) - mark, prompt_tokens, decode_rows))

    def collect(self, rates: StepRates) -> None:
        while self._ended:
            rates.observe(*self._ended.popleft())


class CudaStepTimer:
    """CUDA events on the current stream around each launch, read once the device has passed them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # NOTE: bounded: a step whose events are never read (the engine stopped) must not pile up
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = deque(maxlen=256)
        self._spare: list[torch.cuda.Event] = []  # read events, recorded again rather than created each step

    def _record(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> object:
        return self._record()

    def end(self, mark: object, prompt_tokens: int, decode_rows: int) -> None:
        assert isinstance(mark, torch.cuda.Event)
        self._pending.append((mark, self._record(), prompt_tokens, decode_rows))

    def collect(self, rates: StepRates) -> None:
        pending = self._pending
        while pending and pending[0][1].query():
            start, end, prompt_tokens, decode_rows = pending.popleft()
            rates.observe(start.elapsed_time(end) / 1e3, prompt_tokens, decode_rows)
            self._spare += (start, end)


def step_timer_for(device: torch.device, clock: Callable[[], float]) -> StepTimer:
    return CudaStepTimer(device) if device.type == "cuda" else WallStepTimer(clock)
