"""The paged KV cache: its tensors, and the BlockPool that owns every block id.

Block ownership (shared/DESIGN.md): every block is in exactly one state,

| state  | ref count | hash       | where it is listed                     |
|--------|-----------|------------|----------------------------------------|
| free   | 0         | none       | `_free`                                |
| cached | 0         | registered | `_evictable` (LRU order, oldest first) |
| held   | >= 1      | maybe      | nowhere: its holders know it           |

A held block with a hash is also findable by prefix lookups, so a new request can share it
(its ref count goes up). `check_integrity()` verifies the table above.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import torch

from engine.cache_events import CacheJournal
from engine.models.arch import ArchConfig

BlockHash = bytes
# Cache events a journal keeps: a reader further behind gets a snapshot. 65,536 blocks stored between two reads
# a quarter of a second apart would be 4M prompt tokens a second at 16 tokens a block.
JOURNAL_EVENTS = 65_536


class NoFreeBlocksError(RuntimeError):
    pass


class IntegrityError(AssertionError):
    pass


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of a full block: equal hashes mean equal tokens from position 0 on."""
    data = (parent or b"") + array("q", token_ids).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, known: list[BlockHash]) -> list[BlockHash]:
    """Extends `known` (hashes of the first len(known) blocks) with the hashes of later full blocks."""
    hashes = list(known)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._free: deque[int] = deque(range(num_blocks))
        # what routers mirror of this cache (engine/cache_events.py), read about 4 times a second
        self.journal = CacheJournal(JOURNAL_EVENTS, self._by_hash.keys)

    # ---- asking
    @property
    def num_free_blocks(self) -> int:
        """Blocks an `allocate` may take: free ones plus cached ones no one holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of leading hashes that the cache holds (not yet acquired)."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for h in block_hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    # ---- acting
    def allocate(self, num_blocks: int) -> list[int]:
        """Takes blocks with ref count 1; evicts the least recently used cached blocks when needed."""
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} can be had")
        taken: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self.journal.removed(self._hash[block])  # type: ignore[arg-type]
                del self._by_hash[self._hash[block]]  # type: ignore[index]
                self._hash[block] = None
            self._ref[block] = 1
            taken.append(block)
        return taken

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to blocks found by `find_cached_prefix` (a prefix-cache hit); all or none."""
        blocks = list(block_ids)
        for block in blocks:  # NOTE: check every block before changing any
            self._check_id(block)
            if self._ref[block] == 0 and self._hash[block] is None:
                raise IntegrityError(f"block {block} is free; only cached or held blocks can be acquired")
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IntegrityError(f"block id {block} is outside [0, {self.num_blocks})")

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one holder from each block. Freed tail blocks become the first evicted."""
        for block in reversed(block_ids):
            self._check_id(block)
            if self._ref[block] <= 0:
                raise IntegrityError(f"block {block} freed more often than it was held")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def commit(self, block_id: int, block_hash: BlockHash) -> None:
        """Registers a held, full block under its hash so later prompts can reuse it."""
        self._check_id(block_id)
        if not self.enable_prefix_caching or self._hash[block_id] is not None:
            return
        if self._ref[block_id] <= 0:
            raise IntegrityError(f"block {block_id} is not held; only held blocks can be committed")
        if block_hash in self._by_hash:
            return  # the same content sits in another block already; this one stays private
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        self.journal.stored(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no one holds; returns how many were freed."""
        count = len(self._evictable)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[block]]  # type: ignore[index]
            self._hash[block] = None
            self._free.append(block)
        self.journal.restart()  # NOTE: held blocks keep their hashes: readers get them in a snapshot
        return count

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every block is in exactly one state of the module's table."""
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            raise IntegrityError("a block is listed twice as free")
        if free & evictable:
            raise IntegrityError(f"blocks both free and cached: {sorted(free & evictable)[:8]}")
        strays = sorted(b for b in free | evictable if not 0 <= b < self.num_blocks)
        if strays:
            raise IntegrityError(f"block ids outside [0, {self.num_blocks}) listed as free or cached: {strays[:8]}")
        for block in range(self.num_blocks):
            ref, h = self._ref[block], self._hash[block]
            if ref < 0:
                raise IntegrityError(f"block {block} has ref count {ref}")
            listed = block in free or block in evictable
            if ref > 0 and listed:
                raise IntegrityError(f"block {block} is held (ref {ref}) but listed as free or cached")
            if ref == 0 and not listed:
                raise IntegrityError(f"block {block} has no holder and is neither free nor cached (leaked)")
            if block in free and h is not None:
                raise IntegrityError(f"free block {block} still carries a hash")
            if block in evictable and h is None:
                raise IntegrityError(f"cached block {block} has no hash")
            if h is not None and self._by_hash.get(h) != block:
                raise IntegrityError(f"block {block}'s hash maps to block {self._by_hash.get(h)}")
        if len(self._by_hash) != sum(h is not None for h in self._hash):
            raise IntegrityError("the hash map and the blocks' hashes disagree")


def kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for CacheConfig.kv_cache_dtype `name` in a model of `dtype`."""
    return torch.float8_e4m3fn if name == "fp8" else dtype


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block over all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


def allocate_kv_tensors(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One tensor for the whole cache: [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim].

    NOTE: block ids index dim 2 in every layer, so `kv[:, :, block_ids]` gathers a request's KV
    over all layers in one call (what the KV transfer sends).
    """
    shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
