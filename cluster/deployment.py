"""Starts the worker pools a ClusterConfig asks for and hands their handles to a router.

The driver (the CLI, the Serve application builder, a test) owns the Deployment; `workers()`
is what the router is given. Ray must be initialized first.
"""

from __future__ import annotations

import asyncio

import ray

from cluster.config import ClusterConfig
from cluster.pools import WorkerPool
from cluster.flex_worker import FlexWorker
from decode_worker import DecodeWorkerConfig
from prefill_worker import PrefillWorkerConfig
from router import Workers


INTEGRITY_CHECK_S = 60.0  # a worker's integrity check itself: a command between two engine steps


class Deployment:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.transport = config.resolved_transport(has_gpus)
        gpus = config.resolved_gpus(has_gpus)
        self.prefill: WorkerPool | None = None
        if config.mode == "disaggregated":
            self.prefill = WorkerPool(
                "prefill", FlexWorker, self._prefill_config, config.num_prefill, gpus,
                resources=config.prefill_resources, ranks=config.tp_of("prefill"),
            )
        kind = "decode" if config.mode == "disaggregated" else "colocated"
        self.decode = WorkerPool(
            kind, FlexWorker, self._decode_config, config.num_decode, gpus, resources=config.decode_resources,
            ranks=config.tp_of("decode"),
        )

    def _prefill_config(self, worker_id: str) -> PrefillWorkerConfig:
        # NOTE: freeze_gc: a Ray actor, the process is the worker's alone
        return self.config.worker_config(self.config.prefill, worker_id, self.transport, freeze_gc=True)

    def role_config(self, kind: str, worker_id: str) -> PrefillWorkerConfig | DecodeWorkerConfig:
        """A worker's config for role `kind` ("prefill" or "decode"), e.g. when it changes role."""
        return self._prefill_config(worker_id) if kind == "prefill" else self._decode_config(worker_id)

    def _decode_config(self, worker_id: str) -> DecodeWorkerConfig:
        # NOTE: freeze_gc: a Ray actor, the process is the worker's alone
        return self.config.worker_config(self.config.decode, worker_id, self.transport, freeze_gc=True)

    @property
    def pools(self) -> list[WorkerPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    async def start(self, timeout_s: float = 180.0) -> None:
        for pool in self.pools:
            pool.start()
        for pool in self.pools:
            await pool.wait_ready(timeout_s)

    def workers(self) -> Workers:
        """What routers may use now (WorkerPool.router_handles: no starting worker, retiring ones
        as they drain)."""
        return Workers(
            prefill=self.prefill.router_handles() if self.prefill else {}, decode=self.decode.router_handles()
        )

    async def held_blocks(self, timeout_s: float | None = None) -> dict[str, int]:
        """Every worker's held block count after its integrity check (0 everywhere once drained); a worker
        that does not answer within timeout_s (its engine thread stuck or gone) is a TimeoutError naming it.
        Default: a prefill worker's wait for its pushes under way (longest_push_s), plus INTEGRITY_CHECK_S."""
        if timeout_s is None:
            timeout_s = self.config.prefill.longest_push_s + INTEGRITY_CHECK_S
        held = {}
        for pool in self.pools:
            for worker_id, handle in pool.handles.items():
                try:
                    held[worker_id] = await asyncio.wait_for(handle.check_integrity.remote(), timeout_s)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"{worker_id} did not answer its integrity check within {timeout_s} s; "
                                       "its engine thread is stuck or gone (see its log)") from None
        return held

    def shutdown(self) -> None:
        for pool in self.pools:
            pool.shutdown()
