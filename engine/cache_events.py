"""The prefix cache's changes in order, so that a router can mirror which blocks a worker holds.

Every router replica routes a prompt to the worker whose cache holds its prefix; what one replica sent
is known to it alone, and what a worker evicted to none. So the BlockPool journals each block hash it
registers (stored) and each it drops (removed), numbered from 0 in one `epoch` (a journal's random name;
a new one after the cache is reset or the worker restarts). A reader keeps (epoch, cursor) and asks for
what came since: the events in order, or, when its cursor is from another epoch or older than the last
`capacity` events kept, a snapshot of every hash held now.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import NamedTuple

STORED, REMOVED = 1, 0  # an event's kind byte


class CacheDelta(NamedTuple):
    """What changed in a worker's prefix cache since a reader's cursor. `kinds[i]` says whether
    `hashes[i]` was STORED or REMOVED; applied in order. A snapshot's hashes are every block held now
    (all STORED): the reader drops what it believed before. `cursor` is where the next read starts."""

    epoch: str
    cursor: int
    is_snapshot: bool
    kinds: bytes
    hashes: list[bytes]


class CacheJournal:
    def __init__(self, capacity: int, held: Callable[[], Iterable[bytes]]) -> None:
        """capacity: the fewest events kept (a reader further behind gets a snapshot); held: every hash
        the cache holds now, for a snapshot."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._held = held
        self.epoch = uuid.uuid4().hex
        self._first = 0  # the number of the first event kept
        self._kinds = bytearray()
        self._hashes: list[bytes] = []

    @property
    def cursor(self) -> int:
        """The number the next event will have."""
        return self._first + len(self._hashes)

    def stored(self, block_hash: bytes) -> None:
        self._add(STORED, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._add(REMOVED, block_hash)

    def _add(self, kind: int, block_hash: bytes) -> None:
        self._kinds.append(kind)
        self._hashes.append(block_hash)
        if len(self._hashes) >= 2 * self.capacity:
            self._trim()

    def restart(self) -> None:
        """The cache was reset: every reader starts over from a snapshot."""
        self.epoch = uuid.uuid4().hex
        self._first = 0
        self._kinds.clear()
        self._hashes.clear()

    def since(self, epoch: str, cursor: int) -> CacheDelta:
        """The events from `cursor` of `epoch` on, or a snapshot when they are not all kept."""
        if epoch != self.epoch or not self._first <= cursor <= self.cursor:
            hashes = list(self._held())
            return CacheDelta(self.epoch, self.cursor, True, bytes([STORED]) * len(hashes), hashes)
        start = cursor - self._first
        return CacheDelta(self.epoch, self.cursor, False, bytes(self._kinds[start:]), self._hashes[start:])

    def _trim(self) -> None:
        """Keeps the last `capacity` events (amortized: once every `capacity` events)."""
        drop = len(self._hashes) - self.capacity
        del self._kinds[:drop]
        del self._hashes[:drop]
        self._first += drop
