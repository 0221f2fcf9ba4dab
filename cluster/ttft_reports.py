"""TtftReports: the routers' latest first-token counts against the TTFT SLO (each router sends its own with
every poll of the worker set: router/ttft_window.py), summed for the autoscaler. A router that stopped
polling (it left, or its node did) stops counting after `stale_s`."""

from __future__ import annotations

from cluster.autoscaler import TtftCounts
from protocol.messages import TtftCountsMsg

__all__ = ["TtftReports"]


class TtftReports:
    def __init__(self, stale_s: float = 5.0) -> None:
        self.stale_s = stale_s  # NOTE: routers poll about every second
        self._latest: dict[str, tuple[float, TtftCountsMsg]] = {}  # router id -> (when it came, its counts)

    def add(self, now_s: float, counts: TtftCountsMsg) -> None:
        self._latest[counts.router_id] = (now_s, counts)

    def counts(self, now_s: float) -> TtftCounts | None:
        """Every fresh report summed; None: none."""
        self._latest = {rid: (at, c) for rid, (at, c) in self._latest.items() if now_s - at <= self.stale_s}
        if not self._latest:
            return None
        fresh = [c for _, c in self._latest.values()]
        return TtftCounts(sum(c.num_first_tokens for c in fresh), sum(c.num_over_slo for c in fresh))
