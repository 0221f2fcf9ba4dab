"""Tensor parallelism inside one worker: what each rank holds (shard.py), the ranks' process groups
(group.py), and rank 0's hand-off of each step to the other ranks (follower.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from engine.parallel.group import GroupAddress, PartialSum, TPGroup, host_store, shutdown_beside
from engine.parallel.shard import Shard, TPShard, check_tensor_parallel, kv_head_range, local_arch


class TensorParallel(NamedTuple):
    """A model rank's place (shard) and the group its collectives run over."""

    shard: TPShard
    group: TPGroup

    @classmethod
    def of(cls, group: TPGroup) -> TensorParallel:
        return cls(TPShard(group.rank, group.size), group)


class RankSet(Protocol):
    """Ranks 1..N-1 of one worker, started; `group` is rank 0's place in their group."""

    group: TPGroup

    def is_alive(self) -> bool:
        """False once any rank has died (the group is then aborted: rank 0 cannot go on)."""

    def join(self, timeout_s: float = 30.0) -> None:
        """After rank 0 sent Stop: wait for the ranks to leave, and close the groups."""


class RankStarter(Protocol):
    """Starts the other ranks of a worker of config.parallel.tensor_parallel_size ranks, rank 0 being
    on `device`: engine/parallel/local.py on this machine, cluster/ranks.py as Ray actors."""

    def __call__(self, config: EngineConfig, device: torch.device) -> RankSet: ...


if TYPE_CHECKING:
    from engine.config import EngineConfig

__all__ = [
    "RankSet",
    "RankStarter",
    "GroupAddress",
    "PartialSum",
    "Shard",
    "TPGroup",
    "TPShard",
    "TensorParallel",
    "check_tensor_parallel",
    "host_store",
    "kv_head_range",
    "shutdown_beside",
    "local_arch",
]
