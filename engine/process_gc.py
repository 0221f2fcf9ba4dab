"""The garbage collector of a serving process (a router replica, a worker actor), set once its startup is done.

The startup's objects (the model, the tokenizer, Ray, Serve, pydantic's schemas) live as long as the process: they
are moved out of the collector's reach (gc.freeze), whose full passes over them held the GIL for tens of ms
mid-stream. The youngest generation is collected after GEN0_THRESHOLD new container objects instead of Python's
700: serving makes several a request and a token, so each pass walked the young objects of every stream in flight,
hundreds of times a second. Cycles are still collected.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from engine.recent import RecentMax

GEN0_THRESHOLD = 50_000


def settle_after_startup() -> None:
    """For a process that is one server's alone: cyclic garbage frozen with the startup would never be freed."""
    gc.collect()  # NOTE: first: garbage frozen would never be freed
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)


class GcPauses:
    """The collector's pauses in this process while started (gc.callbacks): their seconds since start and the
    longest of the last 10 s. A pause holds the GIL, so every thread of the process waits it out (a
    tensor-parallel rank's loop, and through the step's collectives every rank's)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._began: float | None = None
        self.seconds = 0.0
        self.recent = RecentMax(clock=clock)

    def start(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    @property
    def longest_recent(self) -> float:
        return self.recent.value()

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = self._clock()
        elif self._began is not None:
            took = self._clock() - self._began
            self._began = None
            self.seconds += took
            self.recent.observe(took)
