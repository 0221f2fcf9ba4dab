"""What rank 0 reports of its worker's other ranks: their CUDA caching allocators' counters (retried
cudaMallocs: the allocator freed its cache to make room; cudaFrees: each synchronizes the rank's device, so
its steps, and through their collectives every rank's, wait for the transfers under way) and where their
loops' time goes (launching forwards, running RankCalls, the collector's pauses). Rank 0 asks with a
RankCall, in order with the steps, and reads the answers at its next stats call: it never waits for them,
so the figures are one call behind."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.follower import RankCall
from engine.parallel.group import TPGroup

__all__ = ["RankReport", "RankStats", "allocator_counts"]


def allocator_counts(device: torch.device) -> tuple[int, int]:
    """(retried cudaMallocs, cudaFrees) of this process's allocator on `device` since start; zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # NOTE: both top-level: no flattening of the rest
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_free", 0))


@dataclass(frozen=True)
class RankReport:
    """The other ranks' figures since start: allocator counts summed over them, each time the largest of any."""

    alloc_retries: int = 0
    device_frees: int = 0
    forward_seconds: float = 0.0  # host seconds launching forwards
    call_seconds: float = 0.0  # host seconds in RankCalls (posting, scattering, gathering KV)
    longest_call_seconds: float = 0.0  # the longest RankCall of the last 10 s
    gc_seconds: float = 0.0  # the collector's pauses
    longest_gc_seconds: float = 0.0  # the longest pause of the last 10 s

    @staticmethod
    def combine(reports: list[RankReport]) -> RankReport:
        return RankReport(sum(r.alloc_retries for r in reports), sum(r.device_frees for r in reports),
                          max((r.forward_seconds for r in reports), default=0.0),
                          max((r.call_seconds for r in reports), default=0.0),
                          max((r.longest_call_seconds for r in reports), default=0.0),
                          max((r.gc_seconds for r in reports), default=0.0),
                          max((r.longest_gc_seconds for r in reports), default=0.0))


def _report(follower: Any, token: str) -> None:
    """A follower's answer (RankCall)."""
    retries, frees = allocator_counts(follower.device)
    report = RankReport(retries, frees, follower.forward_seconds, follower.call_seconds, follower.recent_calls.value(),
                        follower.gc_pauses.seconds, follower.gc_pauses.longest_recent)
    follower.group.report(f"{token}/{follower.group.rank}", json.dumps(dataclasses.astuple(report)))


class RankStats:
    """Rank 0's view of the other ranks: each `report()` reads the answers to the last question if they have
    come (else keeps the last) and asks again once answered."""

    def __init__(self, group: TPGroup, send: Callable[[object], None]) -> None:
        self._group, self._send = group, send
        self._tokens = itertools.count()
        self._pending: list[str] | None = None
        self._last = RankReport()

    def report(self) -> RankReport:
        """The other ranks' figures, as last reported."""
        if self._pending is not None:
            values = self._group.reports(self._pending)
            if values is None:
                return self._last
            self._last = RankReport.combine([RankReport(*json.loads(v)) for v in values])
        token = f"rank-stats/{next(self._tokens)}"
        self._pending = [f"{token}/{rank}" for rank in range(1, self._group.size)]
        self._send(RankCall(_report, (token,)))
        return self._last
