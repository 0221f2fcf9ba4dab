"""Pairs: the prefill side of its KV pairs with decode workers.

A pair is formed on demand (both sides call the transport's `pair` at once; the layouts are
compared there), carries one push at a time (a lock from the handshake until the push's last send
is issued, so the decode side, which posts its receives in the order it accepted handshakes, posts
them in the order they are sent), and is dropped when a transfer on it fails, never waiting on the
peer. Epochs make sure a failed transfer drops only the pair it ran on, not one re-formed since.
A handshake that fails (the pair cannot be formed, or the decode worker does not answer) fails the
handshakes that waited for the lock meanwhile at once, with its reason: each of them would try again
for up to a pair timeout in turn, holding its prompt's blocks all the while (a burst of pushes to a
peer that cannot pair took minutes to drain).
Knows nothing of jobs, leases' blocks or routers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvtransfer.ranked import RankedKv
from protocol.clients import DecodeClient
from protocol.messages import KvReadyMsg


class PushFailed(Exception):
    """A push cannot go on: `reason` says why; `decode_knows`: the decode worker has already freed
    the lease and told the router (it refused the handshake)."""

    def __init__(self, reason: str, decode_knows: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.decode_knows = decode_knows


@dataclass
class Handshake:
    """An accepted handshake: the pair's lock is held until `release`; sends go in this order."""

    decode_id: str
    epoch: int
    lock: asyncio.Lock
    takes_draft: bool  # the decode side posted a receive for the draft's KV too (it goes last)

    def release(self) -> None:
        if self.lock.locked():
            self.lock.release()


class Pairs:
    def __init__(self, transport: RankedKv, worker_id: str, pair_timeout_s: float) -> None:
        """transport: every rank's pairs with a decode worker (kvtransfer/ranked.py)."""
        self.transport = transport
        self.worker_id = worker_id
        self.pair_timeout_s = pair_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._epochs: dict[str, int] = {}  # decode worker -> how many times a pair with it was formed
        self._failed: dict[str, tuple[float, str]] = {}  # decode worker -> when its last handshake failed, why

    async def handshake(self, decode: DecodeClient, ready: KvReadyMsg) -> Handshake:
        """Takes the pair's lock, forms the pair if needed and has the decode worker post its
        receives. Returns with the lock HELD; raises PushFailed (the lock released) otherwise."""
        decode_id = decode.worker_id
        lock = self._locks.setdefault(decode_id, asyncio.Lock())
        queued_at = time.monotonic()
        await lock.acquire()
        failed = self._failed.get(decode_id)
        if failed is not None and failed[0] >= queued_at:
            lock.release()
            raise PushFailed(f"KV push to {decode_id} failed: a handshake while this one waited: {failed[1]}", False)
        epoch = -1
        try:
            await self._ensure_pair(decode)
            epoch = self._epochs[decode_id]
            accept = await asyncio.wait_for(decode.kv_incoming(ready), self.pair_timeout_s)
        except BaseException as err:
            lock.release()
            self.drop(decode_id, epoch)
            if isinstance(err, asyncio.CancelledError):
                raise
            reason = f"{type(err).__name__}: {err}"
            self._failed[decode_id] = (time.monotonic(), reason)
            raise PushFailed(f"KV push to {decode_id} failed: {reason}", False) from None
        if not accept.accepted:
            lock.release()
            if accept.is_unpaired:
                self.drop(decode_id, epoch)  # the decode side lost the pair: form it again next time
            raise PushFailed(f"decode worker refused the KV: {accept.reason}", True)
        return Handshake(decode_id, epoch, lock, accept.draft)

    def drop(self, decode_id: str, epoch: int) -> None:
        """Drops the pair if it is still the one of `epoch` (-1: any), without waiting on the peer."""
        if epoch < 0 or self._epochs.get(decode_id) == epoch:
            self.transport.drop(decode_id)

    async def _ensure_pair(self, decode: DecodeClient) -> None:
        decode_id = decode.worker_id
        if self.transport.is_paired(decode_id):
            return
        timeout = self.pair_timeout_s
        table = await asyncio.wait_for(decode.transport_address(), timeout)
        # NOTE: both sides' pair() are bounded by `timeout`; the extra second lets the peer's own
        # timeout error, which names the cause, arrive first.
        await asyncio.wait_for(asyncio.gather(
            decode.accept_pair(self.worker_id, self.transport.table),
            self.transport.pair_async(table, True, timeout),
        ), timeout + 1.0)
        self._epochs[decode_id] = self._epochs.get(decode_id, 0) + 1


__all__ = ["Handshake", "Pairs", "PushFailed"]
