"""Which prompt blocks each worker holds in its prefix cache, as one router knows it.

Two sources, per worker: what its cache reported (`CacheMirror` reads each worker's journal of
stored and removed blocks, engine/cache_events.py, every `interval_s`: exact up to that read, whichever
router replica sent the prompts and whatever the worker evicted since), and what this router sent it
since (`add`: predicted, so that prompts sharing a prefix a moment apart go to the same worker before
the next read; at most `max_blocks` a worker, least recently sent dropped first). A reported store or
removal replaces the prediction of that block.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from engine.cache_events import STORED
from engine.kv_cache import BlockHash, hash_block, hash_full_blocks
from protocol.api import CacheDeltaMsg
from router.worker_refresh import WorkerRefresh

log = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self, block_size: int = 16, max_blocks: int = 100_000) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._predicted: dict[str, OrderedDict[BlockHash, None]] = {}
        self._held: dict[str, set[BlockHash]] = {}  # reported by the worker's cache

    def hashes(self, prompt: Sequence[int]) -> list[BlockHash]:
        return hash_full_blocks(prompt, self.block_size, [])

    def add(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """Blocks of a prompt sent to `worker_id` (predicted until its cache reports them)."""
        blocks = self._predicted.setdefault(worker_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def apply(self, worker_id: str, delta: CacheDeltaMsg) -> None:
        """What `worker_id`'s cache reported since its last delta: its events in order, or a snapshot.
        Workers of another block size (hashes that could never match) make the index start over in theirs."""
        if delta.block_size != self.block_size:
            log.info("prefix index: workers hash blocks of %d tokens, not %d: starting over", delta.block_size,
                     self.block_size)
            self.block_size = delta.block_size
            self._predicted.clear()
            self._held.clear()
        held = self._held.setdefault(worker_id, set())
        if delta.is_snapshot:
            held.clear()
        predicted = self._predicted.get(worker_id, {})
        for kind, h in zip(delta.kinds, delta.hashes, strict=True):
            if kind == STORED:
                held.add(h)
            else:
                held.discard(h)
            predicted.pop(h, None)

    def _holds(self, worker_id: str, block: BlockHash) -> bool:
        return block in self._held.get(worker_id, ()) or block in self._predicted.get(worker_id, ())

    def match_blocks(self, worker_id: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` believed cached on `worker_id`."""
        count = 0
        for h in hashes:
            if not self._holds(worker_id, h):
                break
            count += 1
        return count

    def forget(self, worker_id: str) -> None:
        self._predicted.pop(worker_id, None)
        self._held.pop(worker_id, None)

    def longest_matches(self, prompt: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """Per worker, leading blocks of `prompt` believed cached there. Hashes only as far as some
        worker still matches: a prompt no one holds costs one hash, not one per block."""
        matched = dict.fromkeys(worker_ids, 0)
        live = [w for w in worker_ids if self._held.get(w) or self._predicted.get(w)]
        parent: BlockHash | None = None
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            if not live:
                break
            parent = hash_block(parent, prompt[start : start + self.block_size])
            live = [w for w in live if self._holds(w, parent)]
            for w in live:
                matched[w] += 1
        return matched


class CacheMirror(WorkerRefresh):
    """Keeps `index` up to date with every tracked worker's prefix cache: one `fetch(worker_id, epoch,
    cursor)` a worker every `interval_s`, in the background."""

    def __init__(self, index: PrefixIndex, fetch: Callable[[str, str, int], Awaitable[CacheDeltaMsg]],
                 interval_s: float = 0.25) -> None:
        super().__init__(interval_s)
        self.index = index
        self.fetch = fetch
        self._cursors: dict[str, tuple[str, int]] = {}  # worker -> (its journal's epoch, where the next read starts)

    def _forget_all_but(self, kept: set[str]) -> None:
        for gone in set(self._cursors) - kept:
            del self._cursors[gone]
            self.index.forget(gone)

    async def refresh(self) -> None:
        def read(worker_id: str) -> Awaitable[CacheDeltaMsg]:
            return self.fetch(worker_id, *self._cursors.get(worker_id, ("", -1)))

        for worker_id, delta in await self._ask_each(read):
            if isinstance(delta, CacheDeltaMsg) and worker_id in self.worker_ids:
                self.index.apply(worker_id, delta)
                self._cursors[worker_id] = (delta.epoch, delta.cursor)
            elif isinstance(delta, BaseException):
                log.debug("prefix cache read of %s failed: %s", worker_id, delta)
