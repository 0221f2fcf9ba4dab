"""Unit tests of engine.kv_cache: the BlockPool's states (free, cached, held), ref counts, LRU
eviction, prefix-cache commit and hits, its integrity check (legal states pass, corrupted ones
raise), the chained block hashes, and the KV tensor's shape and size. Every pool test ends with
a leak check: integrity holds and, once everything is freed, no block is held."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import (
    BlockPool,
    IntegrityError,
    NoFreeBlocksError,
    allocate_kv_tensors,
    bytes_per_block,
    hash_block,
    hash_full_blocks,
)
from engine.models.arch import ArchConfig

BLOCK_SIZE = 4


def _h(key: int) -> bytes:
    """A distinct, valid block hash per key."""
    return hash_block(None, [key] * BLOCK_SIZE)


def _assert_drained(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_held_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks


def _committed(pool: BlockPool, num_blocks: int, first_key: int) -> tuple[list[int], list[bytes]]:
    """Allocates num_blocks held blocks and commits them under chained hashes of distinct tokens."""
    blocks = pool.allocate(num_blocks)
    tokens = [first_key + i for i in range(num_blocks * BLOCK_SIZE)]
    hashes = hash_full_blocks(tokens, BLOCK_SIZE, [])
    for block, h in zip(blocks, hashes):
        pool.commit(block, h)
    return blocks, hashes


# ---- allocate, free, ref counts


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(5, BLOCK_SIZE)
    assert (pool.num_free_blocks, pool.num_held_blocks, pool.num_cached_blocks) == (5, 0, 0)
    assert [pool.ref_count(b) for b in range(5)] == [0] * 5
    _assert_drained(pool)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_pool_rejects_fewer_than_one_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be at least 1, got {num_blocks}"):
        BlockPool(num_blocks, BLOCK_SIZE)


def test_allocate_gives_distinct_blocks_with_ref_one() -> None:
    pool = BlockPool(6, BLOCK_SIZE)
    first, second = pool.allocate(2), pool.allocate(3)
    taken = first + second
    assert len(set(taken)) == 5 and set(taken) <= set(range(6))
    assert all(pool.ref_count(b) == 1 for b in taken)
    assert (pool.num_held_blocks, pool.num_free_blocks) == (5, 1)
    assert pool.allocate(0) == []
    pool.check_integrity()
    pool.free(first)
    assert all(pool.ref_count(b) == 0 for b in first)
    assert (pool.num_held_blocks, pool.num_free_blocks) == (3, 3)
    pool.free(second)
    _assert_drained(pool)


def test_freed_blocks_are_reused() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert sorted(pool.allocate(3)) == [0, 1, 2]
    pool.free([0, 1, 2])
    _assert_drained(pool)


def test_can_allocate_counts_free_and_cached_blocks() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    held = pool.allocate(3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    pool.commit(held[0], _h(1))
    pool.free(held)  # held[0] becomes cached, the others free: all four can be had again
    assert pool.num_cached_blocks == 1
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    _assert_drained(pool)


def test_no_free_blocks_error_names_request_and_supply_and_changes_nothing() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    held = pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match=r"^asked for 2 KV blocks, 1 can be had$"):
        pool.allocate(2)
    assert (pool.num_held_blocks, pool.num_free_blocks) == (3, 1)
    pool.check_integrity()
    pool.free(held)
    _assert_drained(pool)


def test_shared_block_is_free_only_after_its_last_holder_frees_it() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    blocks, hashes = _committed(pool, 2, first_key=0)
    pool.acquire(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert [pool.ref_count(b) for b in blocks] == [1, 1]
    assert pool.num_held_blocks == 2
    pool.check_integrity()
    pool.free(blocks)
    _assert_drained(pool)


def test_double_free_raises() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(IntegrityError, match=f"block {blocks[0]} freed more often than it was held"):
        pool.free(blocks)
    _assert_drained(pool)


def test_double_free_of_a_cached_block_raises() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    blocks, _ = _committed(pool, 1, first_key=0)
    pool.free(blocks)
    with pytest.raises(IntegrityError, match="freed more often"):
        pool.free(blocks)
    assert pool.num_cached_blocks == 1
    _assert_drained(pool)


# ---- LRU eviction


def test_allocate_takes_free_blocks_before_evicting_cached_ones() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    cached, hashes = _committed(pool, 2, first_key=0)
    pool.free(cached)
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(cached)
    assert pool.find_cached_prefix(hashes) == cached
    pool.free(fresh)
    _assert_drained(pool)


def test_eviction_takes_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    a, b, c = pool.allocate(1), pool.allocate(1), pool.allocate(1)
    for blocks, key in ((a, 1), (b, 2), (c, 3)):
        pool.commit(blocks[0], _h(key))
    pool.free(b)
    pool.free(a)
    pool.free(c)  # LRU order now: b, a, c
    assert pool.allocate(1) == b
    assert pool.find_cached_prefix([_h(2)]) == []
    assert pool.find_cached_prefix([_h(1)]) == a and pool.find_cached_prefix([_h(3)]) == c
    assert pool.allocate(1) == a
    assert pool.allocate(1) == c
    assert pool.num_cached_blocks == 0
    pool.free(a + b + c)
    _assert_drained(pool)


def test_a_hit_makes_a_cached_block_most_recently_used() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.commit(a[0], _h(1))
    pool.commit(b[0], _h(2))
    pool.free(a)
    pool.free(b)  # LRU order: a, b
    hit = pool.find_cached_prefix([_h(1)])
    assert hit == a
    pool.acquire(hit)
    pool.free(hit)  # LRU order: b, a
    assert pool.allocate(1) == b
    assert pool.find_cached_prefix([_h(1)]) == a
    pool.free(b)
    _assert_drained(pool)


def test_tail_blocks_of_a_freed_sequence_are_evicted_before_its_head() -> None:
    pool = BlockPool(3, BLOCK_SIZE)
    blocks, hashes = _committed(pool, 3, first_key=0)
    pool.free(blocks)
    taken: list[int] = []
    for remaining in (2, 1, 0):
        taken += pool.allocate(1)
        assert pool.find_cached_prefix(hashes) == blocks[:remaining]
        pool.check_integrity()
    assert taken == blocks[::-1]
    pool.free(taken)
    _assert_drained(pool)


# ---- prefix cache: commit, find, acquire


def test_commit_then_find_cached_prefix_returns_the_longest_leading_run() -> None:
    pool = BlockPool(6, BLOCK_SIZE)
    blocks, hashes = _committed(pool, 3, first_key=0)
    assert pool.num_cached_blocks == 3
    assert pool.find_cached_prefix(hashes) == blocks
    assert pool.find_cached_prefix(hashes[:2]) == blocks[:2]
    assert pool.find_cached_prefix([]) == []
    # A miss ends the run even if later hashes are cached.
    assert pool.find_cached_prefix([hashes[0], _h(99), hashes[2]]) == blocks[:1]
    assert pool.find_cached_prefix([_h(99)] + hashes) == []
    # Finding acquires nothing.
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    pool.free(blocks)
    _assert_drained(pool)


def test_hit_on_cached_block_takes_it_out_of_the_free_count() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    blocks, hashes = _committed(pool, 2, first_key=0)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    hit = pool.find_cached_prefix(hashes)
    assert hit == blocks
    pool.acquire(hit)
    assert [pool.ref_count(b) for b in hit] == [1, 1]
    assert (pool.num_free_blocks, pool.num_held_blocks, pool.num_cached_blocks) == (2, 2, 2)
    # The held hit cannot be evicted: only the two free blocks can be had.
    assert not pool.can_allocate(3)
    rest = pool.allocate(2)
    assert set(rest).isdisjoint(hit)
    assert pool.find_cached_prefix(hashes) == hit
    pool.check_integrity()
    pool.free(hit + rest)
    _assert_drained(pool)


def test_hit_on_a_block_still_held_by_another_holder() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    first, hashes = _committed(pool, 2, first_key=0)
    hit = pool.find_cached_prefix(hashes)
    assert hit == first
    pool.acquire(hit)
    assert [pool.ref_count(b) for b in first] == [2, 2]
    # Sharing takes no extra block.
    assert (pool.num_held_blocks, pool.num_free_blocks) == (2, 2)
    pool.check_integrity()
    pool.free(first)  # the first holder leaves; the second still holds both
    assert [pool.ref_count(b) for b in first] == [1, 1]
    assert pool.num_held_blocks == 2
    pool.allocate(2)  # takes the two free ones: nothing held may be evicted
    assert not pool.can_allocate(1)
    pool.check_integrity()
    pool.free(hit)
    assert pool.num_cached_blocks == 2
    pool.free([b for b in range(4) if b not in hit])
    _assert_drained(pool)


def test_duplicate_content_commit_leaves_the_second_block_private() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    first, second = pool.allocate(1), pool.allocate(1)
    pool.commit(first[0], _h(1))
    pool.commit(second[0], _h(1))
    assert pool.num_cached_blocks == 1
    assert pool.find_cached_prefix([_h(1)]) == first
    pool.check_integrity()
    pool.free(second)  # private: goes back free, not into the cache
    pool.free(first)
    assert pool.num_cached_blocks == 1
    assert pool.reset_prefix_cache() == 1
    _assert_drained(pool)


def test_commit_is_idempotent_and_a_block_keeps_its_first_hash() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    blocks = pool.allocate(1)
    pool.commit(blocks[0], _h(1))
    pool.commit(blocks[0], _h(1))
    pool.commit(blocks[0], _h(2))
    assert pool.num_cached_blocks == 1
    assert pool.find_cached_prefix([_h(1)]) == blocks
    assert pool.find_cached_prefix([_h(2)]) == []
    pool.check_integrity()
    pool.free(blocks)
    _assert_drained(pool)


def test_commit_of_a_free_block_raises() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    with pytest.raises(IntegrityError, match="block 0 is not held"):
        pool.commit(0, _h(1))
    assert pool.num_cached_blocks == 0
    _assert_drained(pool)


def test_acquire_of_a_free_block_raises() -> None:
    pool = BlockPool(2, BLOCK_SIZE)
    with pytest.raises(IntegrityError, match="block 1 is free"):
        pool.acquire([1])
    assert pool.ref_count(1) == 0
    _assert_drained(pool)


def test_reset_prefix_cache_forgets_only_unheld_cached_blocks() -> None:
    pool = BlockPool(6, BLOCK_SIZE)
    idle, idle_hashes = _committed(pool, 3, first_key=0)
    held, held_hashes = _committed(pool, 1, first_key=100)
    pool.free(idle)
    assert pool.num_cached_blocks == 4
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 1
    assert pool.find_cached_prefix(idle_hashes) == []
    assert pool.find_cached_prefix(held_hashes) == held
    assert (pool.num_free_blocks, pool.num_held_blocks) == (5, 1)
    pool.check_integrity()
    assert pool.reset_prefix_cache() == 0
    pool.free(held)
    assert pool.reset_prefix_cache() == 1
    assert pool.num_cached_blocks == 0
    _assert_drained(pool)


def test_prefix_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(4, BLOCK_SIZE, enable_prefix_caching=False)
    blocks = pool.allocate(2)
    hashes = [_h(1), _h(2)]
    for block, h in zip(blocks, hashes):
        pool.commit(block, h)
    assert pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(hashes) == []
    pool.check_integrity()
    pool.free(blocks)
    assert pool.num_cached_blocks == 0
    assert pool.reset_prefix_cache() == 0
    with pytest.raises(IntegrityError, match="is free"):
        pool.acquire(blocks[:1])
    _assert_drained(pool)


# ---- check_integrity on corrupted internals


def _pool_in_every_state() -> tuple[BlockPool, dict[str, int]]:
    """A pool of 5 holding one free, one cached, one held-hashed, one held-private block (and one more free)."""
    pool = BlockPool(5, BLOCK_SIZE)
    cached, held_hashed, held_private = pool.allocate(1)[0], pool.allocate(1)[0], pool.allocate(1)[0]
    pool.commit(cached, _h(1))
    pool.commit(held_hashed, _h(2))
    pool.free([cached])
    free = next(b for b in range(5) if pool.ref_count(b) == 0 and b != cached)
    pool.check_integrity()
    return pool, {"free": free, "cached": cached, "held_hashed": held_hashed, "held_private": held_private}


def test_integrity_passes_with_blocks_in_every_state() -> None:
    pool, blocks = _pool_in_every_state()
    pool.check_integrity()
    assert pool.num_cached_blocks == 2
    pool.free([blocks["held_hashed"], blocks["held_private"]])
    _assert_drained(pool)


Corruption = Callable[[BlockPool, dict[str, int]], None]


def _corrupt_negative_ref(pool: BlockPool, b: dict[str, int]) -> None:
    pool._free.remove(b["free"])
    pool._ref[b["free"]] = -1


def _corrupt_leak(pool: BlockPool, b: dict[str, int]) -> None:
    pool._ref[b["held_private"]] = 0  # a holder vanished without freeing it


def _corrupt_held_but_free(pool: BlockPool, b: dict[str, int]) -> None:
    pool._ref[b["free"]] = 1


def _corrupt_held_but_cached(pool: BlockPool, b: dict[str, int]) -> None:
    pool._ref[b["cached"]] = 1


def _corrupt_listed_twice(pool: BlockPool, b: dict[str, int]) -> None:
    pool._free.append(b["free"])


def _corrupt_free_and_cached(pool: BlockPool, b: dict[str, int]) -> None:
    pool._free.append(b["cached"])


def _corrupt_free_with_hash(pool: BlockPool, b: dict[str, int]) -> None:
    pool._hash[b["free"]] = _h(9)
    pool._by_hash[_h(9)] = b["free"]


def _corrupt_cached_without_hash(pool: BlockPool, b: dict[str, int]) -> None:
    del pool._by_hash[pool._hash[b["cached"]]]  # type: ignore[index]
    pool._hash[b["cached"]] = None


def _corrupt_hash_maps_elsewhere(pool: BlockPool, b: dict[str, int]) -> None:
    pool._by_hash[_h(2)] = b["held_private"]


def _corrupt_stray_hash_entry(pool: BlockPool, b: dict[str, int]) -> None:
    pool._by_hash[_h(9)] = b["held_private"]


def _corrupt_stray_free_id(pool: BlockPool, b: dict[str, int]) -> None:
    pool._free.append(5)  # one past the last block


def _corrupt_stray_cached_id(pool: BlockPool, b: dict[str, int]) -> None:
    pool._evictable[-1] = None


def _corrupt_forgotten_hash_entry(pool: BlockPool, b: dict[str, int]) -> None:
    pool._hash[b["held_private"]] = _h(9)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_negative_ref, "has ref count -1"),
        (_corrupt_leak, "leaked"),
        (_corrupt_held_but_free, "is held .* but listed as free or cached"),
        (_corrupt_held_but_cached, "is held .* but listed as free or cached"),
        (_corrupt_listed_twice, "listed twice as free"),
        (_corrupt_free_and_cached, "both free and cached"),
        (_corrupt_free_with_hash, "free block .* still carries a hash"),
        (_corrupt_cached_without_hash, "cached block .* has no hash"),
        (_corrupt_hash_maps_elsewhere, "hash maps to block"),
        (_corrupt_stray_hash_entry, "the hash map and the blocks' hashes disagree"),
        (_corrupt_forgotten_hash_entry, "hash maps to block None"),
        (_corrupt_stray_free_id, r"outside \[0, 5\) listed as free or cached: \[5\]"),
        (_corrupt_stray_cached_id, r"outside \[0, 5\) listed as free or cached: \[-1\]"),
    ],
)
def test_integrity_raises_on_corrupted_internals(corrupt: Corruption, message: str) -> None:
    pool, blocks = _pool_in_every_state()
    corrupt(pool, blocks)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity()


def test_integrity_raises_on_a_stray_id_that_hides_a_held_block() -> None:
    pool = BlockPool(4, BLOCK_SIZE)
    pool.allocate(1)
    pool._free.append(99)
    assert pool.num_held_blocks == 0  # the stray id hides the held block from the count
    with pytest.raises(IntegrityError, match=r"block ids outside \[0, 4\) listed as free or cached: \[99\]"):
        pool.check_integrity()


# ---- block hashes


def test_hash_block_is_deterministic_and_16_bytes() -> None:
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 16
    assert hash_block(None, [1, 2, 3, 4]) == h
    assert hash_block(None, (1, 2, 3, 4)) == h


def test_hash_block_depends_on_tokens_order_and_parent() -> None:
    parent = hash_block(None, [7, 7, 7, 7])
    other_parent = hash_block(None, [8, 8, 8, 8])
    hashes = {
        hash_block(None, [1, 2, 3, 4]),
        hash_block(None, [1, 2, 3, 5]),
        hash_block(None, [4, 3, 2, 1]),
        hash_block(parent, [1, 2, 3, 4]),
        hash_block(other_parent, [1, 2, 3, 4]),
        hash_block(None, [2**40, 2, 3, 4]),  # large ids are not truncated
        hash_block(None, [0, 2, 3, 4]),
    }
    assert len(hashes) == 7


def test_same_tokens_at_a_different_block_index_hash_differently() -> None:
    hashes = hash_full_blocks([5, 6, 5, 6, 5, 6], 2, [])
    assert len(set(hashes)) == 3


def test_same_block_after_a_different_parent_hashes_differently() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 9, 9], 2, [])
    b = hash_full_blocks([1, 2, 3, 5, 9, 9], 2, [])
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # same tokens, different parent


def test_hash_full_blocks_chains_hash_block() -> None:
    tokens = list(range(100, 112))
    hashes = hash_full_blocks(tokens, 4, [])
    expected: list[bytes] = []
    for i in range(3):
        expected.append(hash_block(expected[-1] if expected else None, tokens[4 * i : 4 * i + 4]))
    assert hashes == expected


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2)])
def test_partial_trailing_block_is_not_hashed(num_tokens: int, num_hashes: int) -> None:
    tokens = list(range(num_tokens))
    hashes = hash_full_blocks(tokens, 4, [])
    assert len(hashes) == num_hashes
    assert hashes == hash_full_blocks(tokens[: num_hashes * 4], 4, [])


@pytest.mark.parametrize("seed", range(5))
def test_incremental_hashes_equal_hashes_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.randint(1, 5)
    tokens = [rng.randrange(50) for _ in range(rng.randint(0, 40))]
    known: list[bytes] = []
    for end in range(len(tokens) + 1):
        before = list(known)
        extended = hash_full_blocks(tokens[:end], block_size, known)
        assert known == before, "known must not be mutated"
        assert extended[: len(known)] == known
        known = extended
    assert known == hash_full_blocks(tokens, block_size, [])
    assert len(known) == len(tokens) // block_size


def test_known_hashes_are_kept_not_recomputed() -> None:
    tokens = list(range(8))
    fake_first = b"\x00" * 16
    hashes = hash_full_blocks(tokens, 4, [fake_first])
    assert hashes == [fake_first, hash_block(fake_first, tokens[4:8])]


# ---- KV tensors


def _arch() -> ArchConfig:
    # Every dimension distinct, and head_dim != hidden_size // num_heads, num_kv_heads != num_heads.
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
    )


@pytest.mark.parametrize(("dtype", "element"), [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
def test_bytes_per_block(dtype: torch.dtype, element: int) -> None:
    # 2 (k, v) * 3 layers * 5 tokens * 2 kv heads * 6 head dim * element
    assert bytes_per_block(_arch(), 5, dtype) == 2 * 3 * 5 * 2 * 6 * element


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocate_kv_tensors_shape_and_block_indexing(dtype: torch.dtype) -> None:
    arch = _arch()
    kv = allocate_kv_tensors(arch, num_blocks=7, block_size=5, dtype=dtype, device=torch.device("cpu"))
    assert kv.shape == (3, 2, 7, 5, 2, 6)  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
    assert kv.dtype == dtype and kv.device.type == "cpu"
    assert not kv.any()
    one_block = kv[:, :, 4]
    assert one_block.numel() * one_block.element_size() == bytes_per_block(arch, 5, dtype)
    assert kv.numel() * kv.element_size() == 7 * bytes_per_block(arch, 5, dtype)
    assert kv[:, :, [1, 3]].shape == (3, 2, 2, 5, 2, 6)


# ---- randomized: random operations against a model of holders


def _chain(keys: list[int]) -> list[bytes]:
    """Chained hashes of a sequence whose i-th block holds only the token keys[i]."""
    return hash_full_blocks([k for k in keys for _ in range(BLOCK_SIZE)], BLOCK_SIZE, [])


class _PoolModel:
    """Drives a BlockPool and checks it against a plain model after every operation.

    The model: each holder owns a list of block ids; a block's ref count is how often holders
    list it; `registry` maps hash -> block for committed blocks; `lru` lists the unheld
    registered blocks, least recently freed first.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        self.enabled = enable_prefix_caching
        self.holders: list[list[int]] = []
        self.registry: dict[bytes, int] = {}
        self.lru: list[int] = []

    def _refs(self) -> list[int]:
        refs = [0] * self.pool.num_blocks
        for blocks in self.holders:
            for b in blocks:
                refs[b] += 1
        return refs

    def _hash_of(self, block: int) -> bytes | None:
        return next((h for h, b in self.registry.items() if b == block), None)

    def _take(self, num_blocks: int) -> list[int]:
        refs = self._refs()
        if num_blocks > self.pool.num_blocks - sum(r > 0 for r in refs):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(num_blocks)
            return []
        plain_free = {b for b in range(self.pool.num_blocks) if refs[b] == 0 and self._hash_of(b) is None}
        taken = self.pool.allocate(num_blocks)
        assert len(taken) == num_blocks == len(set(taken))
        for b in taken:
            assert refs[b] == 0, f"allocate gave block {b}, which is held"
            if plain_free:
                assert b in plain_free, "allocate evicted a cached block while free ones were left"
                plain_free.discard(b)
            else:
                assert self.lru and b == self.lru[0], "allocate did not evict the least recently used block"
                self.lru.pop(0)
                del self.registry[self._hash_of(b)]  # type: ignore[arg-type]
        return taken

    # ---- operations; `pick` chooses a holder or block, `keys` are block contents
    def allocate(self, pick: int, keys: list[int]) -> None:
        """A new holder of len(keys) fresh blocks; an odd `pick` also commits them (a finished prefill)."""
        taken = self._take(len(keys))
        if taken:
            self.holders.append(taken)
            if pick % 2:
                self.commit(len(self.holders) - 1, keys)

    def commit(self, pick: int, keys: list[int]) -> None:
        """Commits the holder's leading blocks as blocks of `keys` (few keys: duplicate content happens)."""
        if not self.holders:
            return
        blocks = self.holders[pick % len(self.holders)]
        for block, h in zip(blocks, _chain(keys)):
            self.pool.commit(block, h)
            if self.enabled and self._hash_of(block) is None and h not in self.registry:
                self.registry[h] = block

    def hit(self, pick: int, keys: list[int]) -> None:
        """A new holder: the cached prefix of `keys`, plus `pick % 3` fresh blocks."""
        hashes = _chain(keys)
        expected: list[int] = []
        for h in hashes:
            if h not in self.registry:
                break
            expected.append(self.registry[h])
        found = self.pool.find_cached_prefix(hashes)
        assert found == expected
        if not found:
            return
        self.pool.acquire(found)
        self.lru = [b for b in self.lru if b not in found]
        self.holders.append(found)  # held before `_take`, so the model counts the hits as held
        self.holders[-1] = found + self._take(pick % 3)

    def free(self, pick: int, keys: list[int]) -> None:
        if not self.holders:
            return
        blocks = self.holders.pop(pick % len(self.holders))
        self.pool.free(blocks)
        refs = self._refs()
        for b in reversed(blocks):  # tail first: the tail is evicted first
            if refs[b] == 0 and self._hash_of(b) is not None:
                self.lru.append(b)

    def reset(self, pick: int, keys: list[int]) -> None:
        assert self.pool.reset_prefix_cache() == len(self.lru)
        for b in self.lru:
            del self.registry[self._hash_of(b)]  # type: ignore[arg-type]
        self.lru = []

    def check(self) -> None:
        assert all(len(set(blocks)) == len(blocks) for blocks in self.holders), "a holder lists a block twice"
        self.pool.check_integrity()
        refs = self._refs()
        assert [self.pool.ref_count(b) for b in range(self.pool.num_blocks)] == refs
        assert self.pool.num_held_blocks == sum(r > 0 for r in refs)
        assert self.pool.num_free_blocks == self.pool.num_blocks - self.pool.num_held_blocks
        assert self.pool.num_cached_blocks == len(self.registry)
        for h, b in self.registry.items():
            assert self.pool.find_cached_prefix([h]) == ([b] if self.enabled else [])


_OPERATIONS = st.lists(
    st.tuples(
        # Weighted: resets are rare, so the cache fills and hits happen.
        st.sampled_from(["allocate"] * 3 + ["hit"] * 3 + ["free"] * 3 + ["commit", "reset"]),
        st.integers(0, 7),  # pick
        st.lists(st.integers(0, 2), min_size=1, max_size=4),  # keys
    ),
    min_size=20,
    max_size=80,
)


@settings(max_examples=50, deadline=None)
@given(
    num_blocks=st.integers(1, 8),
    enable_prefix_caching=st.sampled_from([True, True, True, False]),
    operations=_OPERATIONS,
)
def test_block_pool_random_operations_keep_integrity(
    num_blocks: int, enable_prefix_caching: bool, operations: list[tuple[str, int, list[int]]]
) -> None:
    model = _PoolModel(num_blocks, enable_prefix_caching)
    for name, pick, keys in operations:
        getattr(model, name)(pick, keys)
        model.check()
    while model.holders:
        model.free(0, [])
        model.check()
    _assert_drained(model.pool)


def test_acquire_is_all_or_nothing_and_ids_are_checked():
    pool = BlockPool(num_blocks=4, block_size=2)
    (held,) = pool.allocate(1)
    pool.commit(held, hash_block(None, [1, 2]))
    pool.free([held])  # now cached, evictable
    with pytest.raises(IntegrityError, match="is free"):
        pool.acquire([held, 3])  # block 3 is free: nothing may be acquired
    assert pool.ref_count(held) == 0
    pool.check_integrity()
    for bad in (-1, 4):
        with pytest.raises(IntegrityError, match="outside"):
            pool.free([bad])
