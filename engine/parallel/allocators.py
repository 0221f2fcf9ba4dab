"""The CUDA caching allocator's counters of every rank of a worker, for its stats: retried cudaMallocs
(the allocator freed its cache to make room) and cudaFrees (each synchronizes the rank's device, so its
steps, and through their collectives every rank's, wait for the transfers under way). Rank 0 asks the
other ranks with a RankCall, in order with the steps, and reads their answers at its next stats call:
it never waits for them, so the others' counts are one call behind."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from engine.parallel.follower import RankCall
from engine.parallel.group import TPGroup

__all__ = ["RankAllocators", "allocator_counts"]


def allocator_counts(device: torch.device) -> tuple[int, int]:
    """(retried cudaMallocs, cudaFrees) of this process's allocator on `device` since start; zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # NOTE: both top-level: no flattening of the rest
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("num_device_free", 0))


def _report_counts(follower: Any, token: str) -> None:
    """A follower's answer (RankCall)."""
    retries, frees = allocator_counts(follower.device)
    follower.group.report(f"{token}/{follower.group.rank}", f"{retries} {frees}")


class RankAllocators:
    """Rank 0's view of the other ranks' counters: each `counts()` reads the answers to the last question
    if they have come (else keeps the last sums) and asks again once answered."""

    def __init__(self, group: TPGroup, send: Callable[[object], None]) -> None:
        self._group, self._send = group, send
        self._tokens = itertools.count()
        self._pending: list[str] | None = None
        self._sums = (0, 0)

    def counts(self) -> tuple[int, int]:
        """The other ranks' (retries, frees), summed, as last reported."""
        if self._pending is not None:
            values = self._group.reports(self._pending)
            if values is None:
                return self._sums
            pairs = [tuple(int(x) for x in v.split()) for v in values]
            self._sums = (sum(p[0] for p in pairs), sum(p[1] for p in pairs))
        token = f"allocator/{next(self._tokens)}"
        self._pending = [f"{token}/{rank}" for rank in range(1, self._group.size)]
        self._send(RankCall(_report_counts, (token,)))
        return self._sums
