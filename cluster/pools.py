"""Worker pools: Ray actors of one worker kind, their placement, health, and replacement.

A pool names its workers `<kind>-<n>`; a replaced worker gets a new name (n only grows), so a
dead worker's id is never reused and stale leases or pairs cannot be confused with the new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvtransfer import NCCL_WORKER_ENV

log = logging.getLogger(__name__)


class WorkerPool:
    def __init__(
        self,
        kind: str,
        worker_cls: type,
        make_config: Callable[[str], Any],
        num_workers: int,
        num_gpus: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.worker_cls = worker_cls
        self.make_config = make_config
        self.num_workers = num_workers
        self.num_gpus = num_gpus
        self.env = {**(NCCL_WORKER_ENV if num_gpus > 0 else {}), **(env or {})}
        self.handles: dict[str, Any] = {}
        self._names = itertools.count()
        self._pg: PlacementGroup | None = None
        self._free_bundles: list[int] = []
        self._bundle_of: dict[str, int] = {}

    def start(self) -> None:
        if self.num_gpus > 0:
            # One bundle per worker, packed: prefill and decode pools each get their own group.
            self._pg = placement_group([{"GPU": self.num_gpus}] * self.num_workers, strategy="PACK")
            ray.get(self._pg.ready())
            self._free_bundles = list(range(self.num_workers))
        for _ in range(self.num_workers):
            self._spawn()

    def _spawn(self) -> str:
        worker_id = f"{self.kind}-{next(self._names)}"
        options: dict[str, Any] = dict(
            name=f"pdserve-{worker_id}",
            num_cpus=0,
            num_gpus=self.num_gpus,
            max_concurrency=1000,
            runtime_env={"env_vars": self.env} if self.env else None,
        )
        if self._pg is not None:
            bundle = self._free_bundles.pop(0)
            self._bundle_of[worker_id] = bundle
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._pg, bundle)
        actor_cls = ray.remote(self.worker_cls)
        self.handles[worker_id] = actor_cls.options(**options).remote(self.make_config(worker_id))
        return worker_id

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(h.health.remote() for h in self.handles.values())), timeout_s)

    async def find_dead(self, timeout_s: float = 5.0) -> list[str]:
        """Workers that do not answer a health check (Ray reports them dead, or they hang)."""
        ids = list(self.handles)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.handles[i].health.remote(), timeout_s) for i in ids), return_exceptions=True
        )
        return [i for i, ok in zip(ids, results) if ok is not True]

    def replace(self, worker_id: str) -> str:
        """Drops a dead worker and starts a new one in its place (its bundle, a new id)."""
        handle = self.handles.pop(worker_id)
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if worker_id in self._bundle_of:
            self._free_bundles.append(self._bundle_of.pop(worker_id))
        return self._spawn()

    def shutdown(self) -> None:
        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
