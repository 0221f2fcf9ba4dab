"""What one rank of a tensor-parallel worker holds of the model (Megatron-style sharding).

Rank r of n holds: query heads [r*H/n, (r+1)*H/n); KV heads [r*K/n, (r+1)*K/n) when n divides K,
else the one KV head its query heads attend (K < n: each KV head replicated on n/K ranks); the
MLP's intermediate rows [r*I/n, (r+1)*I/n); and vocabulary rows [r*Vp/n, (r+1)*Vp/n) of the
embedding and lm_head, Vp being the vocabulary padded up to a multiple of n (pad rows are zero,
their logits dropped). Knows nothing of communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # NOTE: engine.models imports this module
    from engine.models.arch import ArchConfig

__all__ = ["Shard", "TPShard", "check_tensor_parallel", "kv_head_range", "local_arch"]


class Shard(NamedTuple):
    """A parameter's slice of the checkpoint tensor: rows (dim 0) or columns (dim 1) [start, stop) of
    a tensor whose size along `dim` is `full`; rows past `full` (vocabulary padding) are zero."""

    dim: int
    start: int
    stop: int
    full: int


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """The model KV heads [start, stop) rank `rank` of `size` holds."""
    if num_kv_heads >= size:
        part = num_kv_heads // size
        return rank * part, (rank + 1) * part
    head = rank * num_kv_heads // size  # the KV head this rank's query heads attend
    return head, head + 1


def check_tensor_parallel(arch: ArchConfig, size: int) -> None:
    """ValueError naming the model field that `size` ranks cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    fields = {"num_attention_heads": arch.num_heads, "intermediate_size": arch.intermediate_size}
    for name, value in fields.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} ({value}); "
                             f"use a size that divides it")
    k = arch.num_kv_heads
    if k % size and size % k:
        raise ValueError(f"tensor_parallel_size {size} and the model's num_key_value_heads ({k}) must divide "
                         "one another (KV heads are split across ranks, or replicated when fewer than ranks)")


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.size})")

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's equal part [start, stop) of `total` (which `size` divides)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def heads(self, arch: ArchConfig) -> tuple[int, int]:
        return self.rows(arch.num_heads)

    def kv_heads(self, arch: ArchConfig) -> tuple[int, int]:
        return kv_head_range(self.rank, self.size, arch.num_kv_heads)

    def padded_vocab(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size) * self.size

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the padded vocabulary (stop may pass vocab_size: padding)."""
        return self.rows(self.padded_vocab(vocab_size))


def local_arch(arch: ArchConfig, shard: TPShard) -> ArchConfig:
    """The shapes one rank computes with: its query and KV heads and intermediate rows (the vocabulary
    and everything else as the model's). Its KV cache, attention and block bytes follow from it."""
    if shard.size == 1:
        return arch
    check_tensor_parallel(arch, shard.size)
    q0, q1 = shard.heads(arch)
    k0, k1 = shard.kv_heads(arch)
    return dataclasses.replace(arch, num_heads=q1 - q0, num_kv_heads=k1 - k0,
                               intermediate_size=arch.intermediate_size // shard.size)
