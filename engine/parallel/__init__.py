"""Tensor parallelism inside one worker: what each rank holds (shard.py), the ranks' process groups
(group.py), and rank 0's hand-off of each step to the other ranks (follower.py)."""

from __future__ import annotations

from typing import NamedTuple

from engine.parallel.group import GroupAddress, TPGroup, host_store
from engine.parallel.shard import Shard, TPShard, check_tensor_parallel, local_arch


class TensorParallel(NamedTuple):
    """A model rank's place (shard) and the group its collectives run over."""

    shard: TPShard
    group: TPGroup

    @classmethod
    def of(cls, group: TPGroup) -> TensorParallel:
        return cls(TPShard(group.rank, group.size), group)


__all__ = ["GroupAddress", "Shard", "TPGroup", "TPShard", "TensorParallel", "check_tensor_parallel", "host_store",
           "local_arch"]
