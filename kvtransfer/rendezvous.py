"""Pair rendezvous over torch.distributed TCPStores: the store a worker hosts for the pairs where it
is rank 0, the client connections it keeps to other hosts' stores, and the handshake by which the
two sides of a pair agree on a fresh key prefix (generation) for their process group.

NOTE: connections are scarce. On torch 2.13 every TCPStore connection costs a reverse DNS lookup
(getnameinfo of the peer) in the store server's single accept thread; where the resolver is slow or
unreachable, a connect (and every other client of that server) stalls for the resolver's timeout
(5 s seen on the CPU sandbox). So the host pairs through its own master store object, a joiner keeps
one client per host address, and nobody opens a connection per pair attempt.

NOTE: one TCPStore object runs one operation at a time (a blocking `wait` holds up every other call
on that object), so the handshake polls with `check`, which returns at once, instead of `wait`.

The host (rank 0) owns a generation counter per pair in its own store. Since the store lives and
dies with the host, the counter is never stale for it; a restarted joiner reads the latest offer,
and a restarted host starts a new store at a new address. Keys, under "pdserve/kv/{host}/{joiner}":

    gen              counter, +1 per attempt of the host                    (host)
    offer            the generation of the host's attempt in progress,      (host)
                     or "withdrawn" once that attempt ended either way
    {gen}/accept     the joiner has read the offer                           (joiner)
    {gen}/go         the host saw the accept: both build the group now       (host)
    {gen}/group/...  the process group's own rendezvous (PrefixStore)

The handshake bounds pairing by `timeout_s` before any process group is built; once both sides
passed it, the group forms in milliseconds, through a PollingStore: the group's own store calls poll
the shared store object instead of blocking it, and fail at the pairing's deadline. So a side that
dies inside that window fails only its own pairing, at the deadline; built straight on the store
object, a gloo group waited on it for the group's whole timeout (max_transfer_s) and held up every
other pairing of that worker meanwhile.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from kvtransfer.transport import PairAddress

__all__ = ["PollingStore", "Rendezvous", "handshake"]

_WITHDRAWN = b"withdrawn"
_POLL_S = 0.002


class Rendezvous:
    """One worker's stores: the master it hosts (started on first use) and its clients of others."""

    def __init__(self, host: str) -> None:
        self._host = host  # the address peers reach this worker at
        self._lock = threading.Lock()
        self._master: dist.TCPStore | None = None
        self._clients: dict[PairAddress, dist.TCPStore] = {}

    def address(self) -> PairAddress:
        return PairAddress(self._host, int(self._master_store().port))

    def store_for(self, address: PairAddress, rank: int, timeout_s: float, what: str) -> dist.TCPStore:
        """The store to pair through: our own master as rank 0, a (cached) client of `address` as rank 1."""
        if rank == 0:
            return self._master_store()
        with self._lock:
            client = self._clients.get(address)
        if client is not None:
            return client
        try:
            client = dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(timeout_s, 0.001)))
        except (dist.DistError, RuntimeError) as e:
            raise TimeoutError(f"{what}: could not reach the rendezvous at {address.host}:{address.port} "
                               f"within {timeout_s:.1f} s ({e})") from e
        with self._lock:
            return self._clients.setdefault(address, client)

    def forget(self, address: PairAddress) -> None:
        """Drop the client of `address` (after it failed), so the next pairing reconnects."""
        with self._lock:
            self._clients.pop(address, None)

    def close(self) -> None:
        with self._lock:
            self._master = None  # the server stops with the last reference
            self._clients.clear()

    def _master_store(self) -> dist.TCPStore:
        with self._lock:
            if self._master is None:
                # Port 0: the OS picks a free port; the store reports the real one.
                self._master = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False,
                                             timeout=timedelta(seconds=30))
            return self._master


class PollingStore(dist.Store):
    """A view of a shared store for one pair's process group: `get` and `wait` poll with `check`
    instead of blocking the shared object, and raise TimeoutError at `deadline` (a monotonic time;
    None once the pair has formed, when a call waits at most its own timeout or `call_timeout_s`).

    NOTE: the group holds only the C++ half of this object; whoever builds the group must keep a
    reference to it for the group's life, or the group's next store call finds no Python methods.
    """

    def __init__(self, store: dist.Store, deadline: float | None, call_timeout_s: float, what: str) -> None:
        super().__init__()
        self._store = store
        self.deadline = deadline
        self._call_timeout_s = call_timeout_s
        self._what = what

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key], None)
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def has_extended_api(self) -> bool:
        return False  # callers fall back to set/get/wait, which poll

    def _wait(self, keys: list[str], timeout: timedelta | None) -> None:
        limit_s = timeout.total_seconds() if timeout is not None else self._call_timeout_s
        deadline = time.monotonic() + limit_s
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        while not self._store.check(keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._what}: the peer did not build its side of the group in time "
                                   f"(waiting for {keys}); did it die after the handshake?")
            time.sleep(_POLL_S)


def _poll(store: dist.TCPStore, key: str, deadline: float, what: str) -> bytes:
    """The value of `key` once it is set (and not withdrawn); TimeoutError at the deadline."""
    while True:
        if store.check([key]):
            value = store.get(key)  # set and never deleted: returns at once
            if value != _WITHDRAWN:
                return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: the peer did not show up in time (waiting for {key!r})")
        time.sleep(_POLL_S)


def handshake(store: dist.TCPStore, host_id: str, joiner_id: str, rank: int, timeout_s: float) -> str:
    """Agree on a fresh generation with the other side; return the group's key prefix."""
    base = f"pdserve/kv/{host_id}/{joiner_id}"
    what = f"pairing {host_id!r} (rank 0) with {joiner_id!r} (rank 1)"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = store.add(f"{base}/gen", 1)
        store.set(f"{base}/offer", str(generation))
        try:
            _poll(store, f"{base}/{generation}/accept", deadline, what)
            store.set(f"{base}/{generation}/go", "1")
        finally:
            # NOTE: always withdrawn, so a joiner arriving later never takes an abandoned offer.
            store.set(f"{base}/offer", _WITHDRAWN)
    else:
        generation = int(_poll(store, f"{base}/offer", deadline, what))
        store.set(f"{base}/{generation}/accept", "1")
        _poll(store, f"{base}/{generation}/go", deadline, what)
    return f"{base}/{generation}/group"
