"""TtftWindow: a router's first tokens over the last `window_s` against the TTFT SLO, which the cluster
controller's autoscaler reads (cluster/autoscaler.py: the prefill pool's measured pressure). A request
still waiting for its first token past the SLO counts as late already: under overload the late ones
are the ones that have not arrived."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from protocol.messages import TtftCountsMsg

__all__ = ["TtftWindow"]


class TtftWindow:
    def __init__(self, router_id: str, ttft_s: float, clock: Callable[[], float], window_s: float = 10.0) -> None:
        if ttft_s <= 0 or window_s <= 0:
            raise ValueError(f"ttft_s ({ttft_s}) and window_s ({window_s}) must be positive")
        self.router_id = router_id
        self.ttft_s = ttft_s
        self.window_s = window_s
        self.clock = clock
        self._firsts: deque[tuple[float, bool]] = deque()  # (when the first token came, later than the SLO)
        self._waiting: dict[object, float] = {}  # a choice still without its first token -> when it began

    def begin(self, key: object) -> None:
        self._waiting[key] = self.clock()

    def first_token(self, key: object) -> None:
        started = self._waiting.pop(key, None)
        if started is not None:
            now = self.clock()
            self._firsts.append((now, now - started > self.ttft_s))

    def end(self, key: object) -> None:
        """The choice is over (first token or not): it no longer waits."""
        self._waiting.pop(key, None)

    def counts(self) -> TtftCountsMsg:
        now = self.clock()
        firsts = self._firsts
        while firsts and now - firsts[0][0] > self.window_s:
            firsts.popleft()
        late_waiting = sum(now - started > self.ttft_s for started in self._waiting.values())
        return TtftCountsMsg(router_id=self.router_id, window_s=self.window_s,
                             num_first_tokens=len(firsts) + late_waiting,
                             num_over_slo=sum(late for _, late in firsts) + late_waiting)
