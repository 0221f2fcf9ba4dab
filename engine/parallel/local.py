"""The other ranks of a tensor-parallel worker started on this machine, for the offline LLM and
benchmarks (a cluster starts one Ray actor per rank instead): threads on the CPU (gloo; tests),
spawned processes on CUDA (rank i on cuda:i, NCCL).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any

import torch

from engine.config import EngineConfig
from engine.parallel.follower import Follower
from engine.parallel.group import GroupAddress, TPGroup, host_store, shutdown_beside
from engine.process_gc import settle_after_startup

__all__ = ["LocalRanks"]
log = logging.getLogger(__name__)


def _rank_main(config_json: str, address: GroupAddress, rank: int, size: int, device: str) -> None:
    """A spawned rank's whole life: join the group, build, follow rank 0 until it stops."""
    config = EngineConfig.model_validate_json(config_json)
    follower = Follower(config, TPGroup(address, rank, size, torch.device(device)))
    if device != "cpu":  # NOTE: a spawned process, the rank's alone (on the CPU a thread of the caller's)
        settle_after_startup()
    follower.run()
    follower.group.close()
    if follower.error is not None:
        raise SystemExit(f"rank {rank} failed: {follower.error}")


class LocalRanks:
    """Starts ranks 1..N-1, then joins the group as rank 0 (blocks until all have joined)."""

    def __init__(self, config: EngineConfig, device: torch.device, host: str = "127.0.0.1") -> None:
        size = config.parallel.tensor_parallel_size
        store = host_store(host)
        address = GroupAddress(host, int(store.port))
        self._workers: list[Any] = []
        config_json = config.model_dump_json()
        for rank in range(1, size):
            worker: Any
            if device.type == "cuda":
                index = (device.index or 0) + rank
                if index >= torch.cuda.device_count():
                    raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from {device}; "
                                     f"{torch.cuda.device_count()} are visible")
                worker = multiprocessing.get_context("spawn").Process(
                    target=_rank_main, args=(config_json, address, rank, size, f"cuda:{index}"),
                    name=f"tp-rank-{rank}", daemon=True)
            else:
                worker = threading.Thread(target=_rank_main, args=(config_json, address, rank, size, "cpu"),
                                          name=f"tp-rank-{rank}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self.group = TPGroup(address, 0, size, device, store=store)
        assert self.group.ring_writer is not None
        self.group.ring_writer.readers_alive = self.is_alive
        self._closing = threading.Event()
        if device.type == "cuda":
            threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True).start()

    def is_alive(self) -> bool:
        return all(w.is_alive() for w in self._workers)

    def _watch(self) -> None:
        """A rank process that dies takes the group down: rank 0's pending collectives fail instead of
        waiting forever for it (NCCL's abort, from this side thread)."""
        while not self._closing.wait(0.5):
            dead = [w for w in self._workers if not w.is_alive()]
            if dead:
                log.error("tensor-parallel %s exited (code %s): aborting the group", dead[0].name, dead[0].exitcode)
                self.group.abort()
                return

    def join(self, timeout_s: float = 30.0) -> None:
        """After rank 0 sent Stop: shut rank 0's groups down while the ranks shut theirs (TPGroup.shutdown),
        wait for the ranks to leave, then close the ring."""
        self._closing.set()
        shutdown = shutdown_beside(self.group)
        for worker in self._workers:
            worker.join(timeout_s)
        shutdown.join(timeout_s)
        self.group.close_ring()
