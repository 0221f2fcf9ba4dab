"""The other ranks of a tensor-parallel worker as Ray actors (engine/parallel's RankStarter for a
cluster): rank 0, the worker actor, starts them in its own placement-group bundle (a bundle of N
GPUs is on one node), so they share its node, and owns them: they die with it.

A rank that dies takes the worker with it: the watcher aborts the group (rank 0's collectives fail
at once instead of waiting on the dead peer), the engine loop ends, the worker's health check says
so, and its pool replaces the worker (its requests move as when a one-GPU worker dies).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from engine.config import EngineConfig
from engine.parallel import GroupAddress, TPGroup, host_store, shutdown_beside
from engine.parallel.follower import Follower
from engine.process_gc import settle_after_startup

log = logging.getLogger(__name__)

_HOST = "127.0.0.1"  # NOTE: every rank of a worker is on rank 0's node
_JOIN_TIMEOUT_S = 600.0  # as TPGroup's default timeout_s


def rank_device(device_type: str, rank: int, visible: tuple[str, ...]) -> torch.device:
    """Rank r's device. Given `visible` (every rank's GPU as Ray names it, in rank order) the rank sees them all and
    takes the r-th, so each rank of the worker has its own device index (symmetric memory, the small all-reduces'
    path, tells ranks apart by it; rank 0, the worker actor, sees its GPU alone as cuda:0, first in the list).
    Without it, Ray's view: the rank's GPU alone, cuda:0. Called before this process starts CUDA."""
    if device_type != "cuda":
        return torch.device("cpu")
    if visible and not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        return torch.device("cuda", rank)
    return torch.device("cuda", 0)


def own_gpu() -> str | None:
    """The one GPU Ray gave this process (its CUDA_VISIBLE_DEVICES), or None (none, or several)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return visible if visible and "," not in visible else None


class RankActor:
    """Rank r (>0) of a worker: builds its part, then follows rank 0 until it stops (`run` blocks)."""

    def gpu(self) -> str | None:
        return own_gpu()

    def run(self, config_json: str, address: GroupAddress, rank: int, size: int, device_type: str,
            visible: tuple[str, ...] = ()) -> None:
        device = rank_device(device_type, rank, visible)
        config = EngineConfig.model_validate_json(config_json)
        follower = Follower(config, TPGroup(address, rank, size, device))
        # NOTE: a Ray actor, the process is the rank's alone; a full collection over the model's and Ray's objects
        # held this rank's loop, and through the step's collectives every rank's (engine/process_gc.py)
        settle_after_startup()
        follower.run()
        follower.group.close()
        if follower.error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {follower.error}")

    def ping(self) -> bool:
        return True


class RayRanks:
    """Starts ranks 1..N-1 in the worker's bundle (GPUs) or on its node (CPU). Pickled into the
    worker actor's constructor by its pool."""

    def __init__(self, bundle: tuple[PlacementGroup, int] | None, num_gpus: float, resources: dict[str, float],
                 env: dict[str, str]) -> None:
        self.bundle, self.num_gpus, self.resources, self.env = bundle, num_gpus, dict(resources), dict(env)

    def __call__(self, config: EngineConfig, device: torch.device) -> RayRankSet:
        if self.bundle is not None:
            strategy: Any = PlacementGroupSchedulingStrategy(*self.bundle)
        else:
            strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = ray.remote(RankActor).options(
            num_cpus=0, num_gpus=self.num_gpus, resources=self.resources or None, max_concurrency=2,
            scheduling_strategy=strategy, runtime_env={"env_vars": self.env} if self.env else None,
        )
        size = config.parallel.tensor_parallel_size
        store = host_store(_HOST)
        address = GroupAddress(_HOST, int(store.port))
        handles = [actor.remote() for _ in range(1, size)]
        visible: tuple[str, ...] = ()
        if device.type == "cuda":
            try:  # NOTE: bounded as the group's own join (TPGroup's timeout_s): a rank Ray cannot place never answers
                gpus = [own_gpu(), *ray.get([h.gpu.remote() for h in handles], timeout=_JOIN_TIMEOUT_S)]
            except Exception as err:  # noqa: BLE001 - the ranks started so far go with this worker
                for handle in handles:
                    ray.kill(handle, no_restart=True)
                if isinstance(err, ray.exceptions.GetTimeoutError):
                    raise RuntimeError(f"the other {size - 1} ranks of this tensor-parallel worker did not start "
                                       f"within {_JOIN_TIMEOUT_S:.0f} s: does its placement-group bundle hold {size} "
                                       "GPUs on one node?") from None
                raise
            if None not in gpus and len(set(gpus)) == size:  # NOTE: else Ray's views, and NCCL all-reduces
                visible = tuple(g for g in gpus if g is not None)
        runs = [h.run.remote(config.model_dump_json(), address, rank, size, device.type, visible)
                for rank, h in enumerate(handles, start=1)]
        return RayRankSet(TPGroup(address, 0, size, device, store=store), handles, runs)


class RayRankSet:
    def __init__(self, group: TPGroup, handles: list[Any], runs: list[Any]) -> None:
        self.group, self._handles, self._runs = group, handles, runs
        self._closing = threading.Event()
        self._dead = threading.Event()
        if group.ring_writer is not None:
            group.ring_writer.readers_alive = self.is_alive
        threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True).start()

    def is_alive(self) -> bool:
        return not self._dead.is_set()

    def _watch(self) -> None:
        """A rank's `run` returns only when rank 0 stopped it: earlier, that rank failed or died."""
        done, _ = ray.wait(self._runs, num_returns=1, timeout=None)
        if self._closing.is_set():
            return
        self._dead.set()
        try:
            ray.get(done[0])
            why = "it left its loop"
        except Exception as err:  # noqa: BLE001 - what the log says
            why = str(err).splitlines()[0]
        log.error("a tensor-parallel rank of this worker died (%s): aborting the group", why)
        self.group.abort()

    def join(self, timeout_s: float = 30.0) -> None:
        self._closing.set()
        shutdown = shutdown_beside(self.group)  # NOTE: the ranks' own shutdowns wait for rank 0's
        try:
            ray.get(self._runs, timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - killed below either way
            log.warning("tensor-parallel ranks did not stop cleanly: %s", err)
        for handle in self._handles:
            ray.kill(handle, no_restart=True)
        shutdown.join(timeout_s)
        self.group.close_ring()
