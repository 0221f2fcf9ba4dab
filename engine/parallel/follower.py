"""A rank other than 0 of a tensor-parallel worker: builds its parts as rank 0 does (engine/rank.py),
then runs what rank 0 hands it, in order, until rank 0 says stop or the group fails.

Messages (over the shared-memory ring, TPGroup.broadcast_object): a runner.ForwardStep (run the same
forward; its logits are rank 0's business), a RankCall (a function of this rank's parts: moving
its KV heads), or Stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from engine.config import EngineConfig
from engine.parallel import TensorParallel, TPGroup
from engine.process_gc import GcPauses
from engine.recent import RecentMax
from engine.rank import build_cache, build_parts, build_runner, max_model_len, resolve_dtype, resolve_model_dir
from engine.runner import ForwardStep, ModelRunner

__all__ = ["Follower", "RankCall", "Stop"]
log = logging.getLogger(__name__)


class Stop(NamedTuple):
    """Rank 0 is closing: leave the loop."""


class RankCall(NamedTuple):
    """Run `fn(follower, *args)` on every follower, in order with the steps (it sees the KV every
    earlier step wrote). It must not block on rank 0."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


class Follower:
    def __init__(self, config: EngineConfig, group: TPGroup) -> None:
        """config: rank 0's; the group's device is this rank's."""
        self.group = group
        self.device = device = group.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NOTE: Triton launches on the current device, whatever the tensors'
        dtype = resolve_dtype(config.model.dtype, device)
        tp = TensorParallel.of(group)
        self.parts = build_parts(config, resolve_model_dir(config.model.model), device, dtype, tp)
        model_len = max_model_len(self.parts.arch, config.model.max_model_len)
        self.kv = build_cache(config, self.parts, device, model_len, tp)
        capacity = self.kv.shape[2] * config.cache.block_size
        self.runner: ModelRunner = build_runner(config, self.parts, self.kv, device, min(model_len, capacity), tp)
        self.error: BaseException | None = None
        # where this loop's time goes, since start (rank 0's stats read them: engine/parallel/rank_stats.py)
        self.forward_seconds = 0.0
        self.call_seconds = 0.0
        self.recent_calls = RecentMax()  # the RankCalls' seconds, the longest of the last 10 s
        self.gc_pauses = GcPauses()  # the collector's pauses while it runs

    def run(self) -> None:
        """Serve rank 0's messages until Stop; a failed group (rank 0 died) ends it with `error` set."""
        self.gc_pauses.start()
        try:
            while True:
                message = self.group.broadcast_object()
                started = time.perf_counter()
                if isinstance(message, ForwardStep):
                    self.runner.forward(message.seqs)
                    self.forward_seconds += time.perf_counter() - started
                elif isinstance(message, RankCall):
                    message.fn(self, *message.args)
                    took = time.perf_counter() - started
                    self.call_seconds += took
                    self.recent_calls.observe(took)
                elif isinstance(message, Stop):
                    self.runner.release_graphs()  # NOTE: before the group shuts down (CUDA graphs captured its calls)
                    return
                else:
                    raise TypeError(f"rank {self.group.rank}: unknown message {type(message).__name__}")
        except BaseException as err:  # noqa: BLE001 - kept for the owner, then the loop ends
            log.exception("tensor-parallel rank %d stopped", self.group.rank)
            self.error = err
        finally:
            self.gc_pauses.stop()
