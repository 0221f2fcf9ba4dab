"""The largest of the values observed in the last few seconds: a figure every reader sees alike (a stats
call, a metrics scrape, `pdserve status`), where resetting on each read would show whichever read came last."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["RecentMax"]


class RecentMax:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_kept: int = 4096) -> None:
        self.window_s = window_s
        self._clock = clock
        self._seen: deque[tuple[float, float]] = deque(maxlen=max_kept)  # (when, value), oldest first

    def observe(self, value: float) -> None:
        self._seen.append((self._clock(), value))

    def value(self) -> float:
        """The largest value observed within the window (0.0 if none)."""
        since = self._clock() - self.window_s
        for _ in range(10):  # NOTE: bounded; collector pauses come seconds apart, not mid-read each time
            try:
                while self._seen and self._seen[0][0] < since:
                    self._seen.popleft()
                return max((v for _, v in self._seen), default=0.0)
            except (RuntimeError, IndexError):  # NOTE: another thread observed (a collector pause there) meanwhile
                continue
        return 0.0
