"""The workers of several serving modes alive at once on two GPUs, each mode with its own workers,
so that a benchmark can measure the modes in turns (bench.disagg) instead of one after another.

Why not one cluster.Deployment per mode: two disaggregated Deployments name their actors alike
(`pdserve-prefill-0`, a Ray name clash), and each pool reserves its own placement group of
fractional-GPU bundles, so which physical GPU a worker lands on is Ray's choice: a prefill worker
and its decode worker could share one GPU, and the KV would not cross NVLink.

Placement here (with GPUs): one placement group of two whole-GPU bundles, so two distinct GPUs:

    bundle 0, "prefill GPU"   every colocated worker and every prefill worker
    bundle 1, "decode GPU"    every decode worker

Each worker asks for an equal fraction of its bundle's GPU (Ray then gives it that GPU), and its
engine sizes its KV cache from `gpu_memory_utilization`, which must be each worker's share: the
fraction of the whole GPU it may use, so that the workers of one GPU fit together. Without GPUs
the workers are plain CPU actors.

Knows nothing of what is measured; the router side is one `Workers` per mode (`workers(name)`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kvtransfer import NCCL_WORKER_ENV
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Workers

__all__ = ["ModeSpec", "SideBySide"]

PREFILL_GPU, DECODE_GPU = 0, 1  # bundle indices of the placement group
MAX_GPU_MEMORY_SHARE = 0.95  # of one GPU, for all its workers' gpu_memory_utilization together


@ray.remote(num_cpus=0, num_gpus=0.01)
def _gpu_ids() -> list[str]:
    """The physical GPU ids of the bundle this task runs in (a probe, run before the workers)."""
    return [str(g) for g in ray.get_gpu_ids()]


@dataclass(frozen=True)
class ModeSpec:
    """One mode: a colocated worker, or one prefill and one decode worker (1P1D)."""

    name: str
    is_disaggregated: bool


@dataclass(frozen=True)
class _WorkerSpec:
    worker_id: str
    mode: str
    role: str  # "colocated", "prefill" or "decode"
    gpu: int  # bundle index


class SideBySide:
    def __init__(
        self, modes: list[ModeSpec], engine: EngineConfig, transport: str, use_gpus: bool, host: str = "127.0.0.1",
        transfer_timeout_s: float = 30.0, lease_ttl_s: float = 30.0,
    ) -> None:
        """`use_gpus`: place the workers on two GPUs of one node (False: CPU actors). Needs no Ray
        until `start`."""
        names = [m.name for m in modes]
        if len(set(names)) != len(names):
            raise ValueError(f"mode names must be unique, got {names}")
        self.modes = {m.name: m for m in modes}
        self.engine = engine
        self.transport = transport
        self.host = host
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.specs: list[_WorkerSpec] = []
        for m in modes:
            if m.is_disaggregated:
                self.specs.append(_WorkerSpec(f"{m.name}-prefill", m.name, "prefill", PREFILL_GPU))
                self.specs.append(_WorkerSpec(f"{m.name}-decode", m.name, "decode", DECODE_GPU))
            else:
                self.specs.append(_WorkerSpec(f"{m.name}-worker", m.name, "colocated", PREFILL_GPU))
        self.max_workers_per_gpu = max(sum(s.gpu == g for s in self.specs) for g in (PREFILL_GPU, DECODE_GPU))
        self.is_on_gpus = use_gpus
        if use_gpus:
            share = engine.cache.gpu_memory_utilization
            if engine.cache.num_blocks is None and share * self.max_workers_per_gpu > MAX_GPU_MEMORY_SHARE:
                raise ValueError(
                    f"gpu_memory_utilization is {share} for each of {self.max_workers_per_gpu} workers on one GPU "
                    f"({share * self.max_workers_per_gpu:.2f} of it); it must be at most "
                    f"{MAX_GPU_MEMORY_SHARE / self.max_workers_per_gpu:.3f} (or set num_blocks)"
                )
        # Ray's fractions are fixed point: round down to a hundredth so that the workers fit the bundle.
        self.num_gpus_per_worker = math.floor(100 / self.max_workers_per_gpu) / 100 if self.is_on_gpus else 0.0
        self.handles: dict[str, Any] = {}  # worker id -> actor handle
        self.gpu_ids: list[list[str]] = []  # by bundle: the physical GPU ids Ray gave it (known once started)
        self._pg: PlacementGroup | None = None

    def _config(self, spec: _WorkerSpec) -> PrefillWorkerConfig | DecodeWorkerConfig:
        common = dict(worker_id=spec.worker_id, engine=self.engine, transport=self.transport, host=self.host,
                      transfer_timeout_s=self.transfer_timeout_s)
        if spec.role == "prefill":
            return PrefillWorkerConfig(**common)
        return DecodeWorkerConfig(**common, lease_ttl_s=self.lease_ttl_s)

    async def start(self, timeout_s: float = 600.0) -> None:
        if self.is_on_gpus:
            num_gpus = ray.cluster_resources().get("GPU", 0)
            if num_gpus < 2:
                raise ValueError(f"use_gpus: the Ray cluster has {num_gpus} GPUs; two are needed (or run on the CPU)")
            # NOTE: whole-GPU bundles: two bundles of one group are two distinct GPUs of one node.
            self._pg = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="STRICT_PACK")
            await asyncio.wait_for(self._pg.ready(), timeout_s)
            probes = [
                _gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, g)).remote()
                for g in (PREFILL_GPU, DECODE_GPU)
            ]
            self.gpu_ids = list(await asyncio.wait_for(asyncio.gather(*probes), timeout_s))
            assert self.gpu_ids[PREFILL_GPU] != self.gpu_ids[DECODE_GPU], self.gpu_ids  # two whole-GPU bundles
        for spec in self.specs:
            options: dict[str, Any] = dict(num_cpus=0, num_gpus=self.num_gpus_per_worker, max_concurrency=1000)
            if self._pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._pg, spec.gpu)
                options["runtime_env"] = {"env_vars": dict(NCCL_WORKER_ENV)}
            worker_cls = PrefillWorker if spec.role == "prefill" else DecodeWorker
            self.handles[spec.worker_id] = ray.remote(worker_cls).options(**options).remote(self._config(spec))
        await asyncio.wait_for(asyncio.gather(*(h.health.remote() for h in self.handles.values())), timeout_s)

    def workers(self, mode: str) -> Workers:
        """The router's view of one mode: its prefill worker (none when colocated) and its decode or
        colocated worker."""
        specs = [s for s in self.specs if s.mode == mode]
        return Workers.of(
            prefill={s.worker_id: self.handles[s.worker_id] for s in specs if s.role == "prefill"},
            decode={s.worker_id: self.handles[s.worker_id] for s in specs if s.role != "prefill"},
        )

    def placement(self) -> dict[str, dict[str, Any]]:
        """Worker ids by GPU bundle ("gpu0": colocated and prefill workers, "gpu1": decode workers)
        with the physical GPU ids of each (once started), or all under "cpu"."""
        if not self.is_on_gpus:
            return {"cpu": {"workers": [s.worker_id for s in self.specs]}}
        return {
            f"gpu{g}": {
                "gpu_ids": self.gpu_ids[g] if self.gpu_ids else None,
                "workers": [s.worker_id for s in self.specs if s.gpu == g],
            }
            for g in (PREFILL_GPU, DECODE_GPU)
        }

    async def held_blocks(self, mode: str) -> dict[str, int]:
        """Each of the mode's workers' held block count after its integrity check (0 once drained)."""
        ids = [s.worker_id for s in self.specs if s.mode == mode]
        return {i: await self.handles[i].check_integrity.remote() for i in ids}

    def shutdown(self) -> None:
        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.handles.clear()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
