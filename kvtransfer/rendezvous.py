"""Pair rendezvous over a torch.distributed TCPStore: which worker hosts the store, and how the two
sides of a pair agree on a fresh key prefix (generation) for their process group.

The host (rank 0) owns a generation counter per pair in its own store. Since the store lives and
dies with the host, the counter is never stale for it: a restarted joiner simply reads the host's
latest offer, and a restarted host starts a new store at a new address.

Keys, under "pdserve/kv/{host_id}/{joiner_id}":

    gen              counter, +1 per attempt of the host                    (host)
    offer            the generation of the host's attempt in progress        (host sets, deletes when done)
    {gen}/accept     the joiner has read the offer                           (joiner)
    {gen}/go         the host saw the accept: both build the group now       (host)
    {gen}/group/...  the process group's own rendezvous (PrefixStore)

The handshake bounds pairing by `timeout_s` before any process group is built: once both sides
passed it, the group forms in milliseconds. (A side that dies inside that window leaves the
other waiting for the group's own timeout.)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from kvtransfer.transport import PairAddress

__all__ = ["StoreHost", "connect", "handshake"]


class StoreHost:
    """The TCPStore server a worker hosts for the pairs where it is rank 0; started on first use."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._lock = threading.Lock()
        self._store: dist.TCPStore | None = None

    def address(self) -> PairAddress:
        with self._lock:
            if self._store is None:
                # Port 0: the OS picks a free port; the store reports the real one.
                self._store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=30))
            return PairAddress(self._host, int(self._store.port))

    def close(self) -> None:
        with self._lock:
            self._store = None  # the server stops with the last reference


def connect(address: PairAddress, timeout_s: float, what: str) -> dist.TCPStore:
    """A client of the store at `address` (one per pair attempt, so no pair waits on another's
    blocking store call)."""
    try:
        return dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(timeout_s, 0.001)))
    except (dist.DistError, RuntimeError) as e:
        raise TimeoutError(f"{what}: could not reach the rendezvous at {address.host}:{address.port} "
                           f"within {timeout_s:.1f} s ({e})") from e


def _wait_key(store: dist.TCPStore, key: str, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    try:
        if remaining <= 0:
            raise dist.DistStoreError(f"no time left to wait for {key}")
        store.wait([key], timedelta(seconds=remaining))
    except (dist.DistError, RuntimeError) as e:
        raise TimeoutError(f"{what}: the peer did not show up in time (waiting for {key!r})") from e


def handshake(store: dist.TCPStore, host_id: str, joiner_id: str, rank: int, timeout_s: float) -> str:
    """Agree on a fresh generation with the other side; return the group's key prefix."""
    base = f"pdserve/kv/{host_id}/{joiner_id}"
    what = f"pairing {host_id!r} (rank 0) with {joiner_id!r} (rank 1)"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        generation = store.add(f"{base}/gen", 1)
        store.set(f"{base}/offer", str(generation))
        try:
            _wait_key(store, f"{base}/{generation}/accept", deadline, what)
            store.set(f"{base}/{generation}/go", "1")
        finally:
            # NOTE: always withdrawn, so a joiner arriving later never takes an abandoned offer.
            store.delete_key(f"{base}/offer")
    else:
        _wait_key(store, f"{base}/offer", deadline, what)
        try:
            generation = int(store.get(f"{base}/offer"))
        except (dist.DistError, RuntimeError) as e:  # withdrawn between the wait and the get
            raise TimeoutError(f"{what}: the host gave up before we joined") from e
        store.set(f"{base}/{generation}/accept", "1")
        _wait_key(store, f"{base}/{generation}/go", deadline, what)
    return f"{base}/{generation}/group"
