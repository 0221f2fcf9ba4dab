"""Unit tests of engine.cache_events and the BlockPool's journal: a reader that applies the deltas in
order holds exactly the hashes the pool's prefix cache holds, through commits, duplicates, evictions
and a reset; a reader too far behind, or of another epoch, gets a snapshot. Pool tests end with a
leak check."""

from __future__ import annotations

import random

import pytest

from engine.cache_events import REMOVED, STORED, CacheDelta, CacheJournal
from engine.kv_cache import BlockPool, hash_block


def _h(key: int) -> bytes:
    return hash_block(None, [key] * 4)


class Reader:
    """What a router does with the deltas (router/prefix_index.py keeps the same rules)."""

    def __init__(self) -> None:
        self.epoch, self.cursor, self.held = "", -1, set()
        self.num_snapshots = 0

    def read(self, journal: CacheJournal) -> CacheDelta:
        delta = journal.since(self.epoch, self.cursor)
        if delta.is_snapshot:
            self.held.clear()
            self.num_snapshots += 1
        for kind, h in zip(delta.kinds, delta.hashes, strict=True):
            (self.held.add if kind == STORED else self.held.discard)(h)
        self.epoch, self.cursor = delta.epoch, delta.cursor
        return delta


def test_events_come_in_order_from_the_cursor_and_a_stale_cursor_gets_a_snapshot():
    held = {_h(1), _h(2)}
    journal = CacheJournal(3, lambda: held)
    first = journal.since("", -1)
    assert first.is_snapshot and set(first.hashes) == held and first.kinds == bytes([STORED, STORED])
    journal.stored(_h(3))
    journal.removed(_h(1))
    delta = journal.since(first.epoch, first.cursor)
    assert not delta.is_snapshot
    assert (delta.kinds, delta.hashes, delta.cursor) == (bytes([STORED, REMOVED]), [_h(3), _h(1)], 2)
    assert journal.since(first.epoch, delta.cursor).hashes == []  # nothing new
    for key in range(10, 16):  # past 2 x capacity: the oldest events are dropped
        journal.stored(_h(key))
    assert journal.since(first.epoch, delta.cursor).is_snapshot
    assert journal.since(first.epoch, journal.cursor - 3).hashes == [_h(13), _h(14), _h(15)]
    assert journal.since("another epoch", journal.cursor).is_snapshot
    assert journal.since(first.epoch, journal.cursor + 1).is_snapshot  # a cursor from a journal before a restart
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        CacheJournal(0, lambda: ())


def test_a_reader_of_the_pool_s_journal_holds_what_its_prefix_cache_holds():
    pool = BlockPool(8, 4)
    pool.journal = CacheJournal(5, pool._by_hash.keys)  # small: the random walk below outruns it at times
    reader = Reader()
    rng = random.Random(0)
    held_blocks: list[int] = []
    for step in range(400):
        action = rng.random()
        if action < 0.5 and pool.can_allocate(1):
            block = pool.allocate(1)[0]
            pool.commit(block, _h(rng.randrange(12)))  # some contents repeat: a duplicate stays private
            held_blocks.append(block)
        elif held_blocks:
            pool.free([held_blocks.pop(rng.randrange(len(held_blocks)))])
        if step % 150 == 149:
            pool.reset_prefix_cache()
        if rng.random() < 0.3:
            reader.read(pool.journal)
            assert reader.held == set(pool._by_hash), step
    reader.read(pool.journal)
    assert reader.held == set(pool._by_hash)
    assert 1 <= reader.num_snapshots < 40  # the first read, each reset, and the times it fell behind
    pool.free(held_blocks)
    pool.check_integrity()
    assert pool.num_held_blocks == 0


def test_evictions_duplicates_and_a_reset_are_journaled():
    pool = BlockPool(2, 4)
    reader = Reader()
    reader.read(pool.journal)
    a, b = pool.allocate(2)
    pool.commit(a, _h(1))
    pool.commit(b, _h(1))  # the same content already sits in block a: not registered, not journaled
    pool.commit(a, _h(1))  # already registered
    assert reader.read(pool.journal).hashes == [_h(1)]
    pool.free([a, b])
    c = pool.allocate(2)  # the free block first, then the cached one is evicted
    delta = reader.read(pool.journal)
    assert (delta.kinds, delta.hashes) == (bytes([REMOVED]), [_h(1)]) and reader.held == set()
    pool.commit(c[0], _h(2))
    pool.free(c)
    epoch = pool.journal.epoch
    assert pool.reset_prefix_cache() == 1
    delta = reader.read(pool.journal)
    assert delta.is_snapshot and delta.epoch != epoch and reader.held == set()
    pool.check_integrity()
    assert pool.num_held_blocks == 0
