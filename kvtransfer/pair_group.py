"""What the torch.distributed transports (gloo, NCCL) share: one process group of size 2 per pair,
built on a PrefixStore over a polling view of the rank-0 side's TCPStore with no default process
group, so pairs form and fail independently (shared/gpu/README.md, point 1; rendezvous.py); pairing
with the layout check; dropping without blocking; and, for backends whose works cannot be polled, a
waiter thread.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.layout import KvLayout, LayoutMismatchError
from kvtransfer.rendezvous import PollingStore, Rendezvous, handshake
from kvtransfer.transport import EventHandle, PairAddress, TransferError, TransferHandle, Transport

__all__ = ["PairGroupTransport", "Pair", "Waiter", "TAG_DATA", "TAG_LAYOUT"]

TAG_DATA = 0
TAG_LAYOUT = 1


class Pair:
    """One formed pair. `rank` is this side's rank in the pair's group; the peer's is 1 - rank."""

    def __init__(self, peer_id: str, rank: int, group: Any, stream: Any = None) -> None:
        self.peer_id = peer_id
        self.rank = rank
        self.peer_rank = 1 - rank
        self.group = group
        self.stream = stream  # NCCL: the pair's own CUDA stream (a dead peer poisons only it)
        self.store: PollingStore | None = None  # the group's store: kept alive as long as the group
        self.lock = threading.Lock()  # guards is_dropped and the waiters
        self.is_dropped = False
        self.waiters: dict[str, Waiter] = {}  # gloo: "send"/"recv" -> waiter thread
        self.threads: list[threading.Thread] = []  # every thread working for this pair, for close()


class Waiter:
    """A daemon thread that waits, in issue order, on the works of one direction of one pair, and
    finishes their handles.

    NOTE: why a thread: on gloo (torch 2.13) `Work.is_completed()` of a send/recv stays False until
    `wait()` is called, and a `wait(timeout)` that times out closes the whole pair; so completion can
    only be observed by a blocking `wait()`, which must not run on the caller's thread. Works of one
    direction of a pair complete in issue order, so waiting on them one after another loses nothing.
    """

    def __init__(self, pair: Pair, direction: str, explain: Callable[[Pair, BaseException], TransferError]) -> None:
        self._pair = pair
        self._explain = explain
        self._queue: queue.SimpleQueue[tuple[Any, EventHandle] | None] = queue.SimpleQueue()
        thread = threading.Thread(target=self._run, name=f"kvtransfer-{direction}-{pair.peer_id}", daemon=True)
        pair.threads.append(thread)
        thread.start()

    def submit(self, work: Any, handle: EventHandle) -> None:
        self._queue.put((work, handle))

    def stop(self) -> None:
        """Exit once the works already submitted have finished (or failed)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, handle = item
            try:
                work.wait()  # bounded by the group's timeout, or ended early by an abort
                handle.finish()
            except Exception as e:  # noqa: BLE001 - every failure becomes the handle's error
                handle.finish(self._explain(self._pair, e))


class PairGroupTransport(Transport):
    """Pairing, bookkeeping and dropping shared by gloo and NCCL; subclasses build the group, start
    the ops and abort a group."""

    binds_network = True

    def __init__(self, self_id: str, layout: KvLayout, device: torch.device | str, host: str = "127.0.0.1",
                 max_transfer_s: float = 600.0) -> None:
        """host: the address peers reach this worker at (its store and its gloo sockets bind there).
        max_transfer_s: the longest a single transfer may be outstanding before the backend fails
        it (the process group's timeout)."""
        super().__init__(self_id, layout, device)
        self.max_transfer_s = max_transfer_s
        self._host = host
        self._rendezvous = Rendezvous(host)
        self._lock = threading.Lock()
        self._pairs: dict[str, Pair] = {}

    def address(self) -> PairAddress:
        return self._rendezvous.address()

    def pair(self, peer_id: str, address: PairAddress, rank: int, timeout_s: float) -> None:
        self._check_rank(rank)
        if rank == 0 and address != self.address():
            raise ValueError(f"rank 0 hosts the rendezvous, so its address must be its own "
                             f"{self.address()}, got {address}")
        self.drop(peer_id)  # re-pairing replaces the old pair
        deadline = time.monotonic() + timeout_s
        host_id, joiner_id = (self.self_id, peer_id) if rank == 0 else (peer_id, self.self_id)
        what = f"{self.self_id!r} pairing with {peer_id!r}"
        store = self._rendezvous.store_for(address, rank, timeout_s, what)
        try:
            prefix = handshake(store, host_id, joiner_id, rank, timeout_s)
        except RuntimeError as e:  # the store itself failed (its host died?): reconnect next time
            self._rendezvous.forget(address)
            raise TransferError(f"{what}: the rendezvous at {address.host}:{address.port} failed: {e}") from e
        view = PollingStore(store, deadline, self.max_transfer_s, what)
        try:
            pair = self._form(peer_id, rank, dist.PrefixStore(prefix, view))
        except Exception as e:
            raise TransferError(f"forming the {self.name} group of {host_id!r} and {joiner_id!r} failed: {e}") from e
        pair.store = view
        try:
            self._exchange_layouts(pair, deadline - time.monotonic())  # NCCL's lazy init uses the view here
        except BaseException:
            self._release(pair)
            raise
        view.deadline = None  # formed: a later store call of the group waits its own timeout
        with self._lock:
            old = self._pairs.pop(peer_id, None)  # a concurrent pair() with the same peer lost the race
            self._pairs[peer_id] = pair
        if old is not None:
            self._release(old)

    def _exchange_layouts(self, pair: Pair, timeout_s: float) -> None:
        """Send ours, receive theirs, compare: LayoutMismatchError on both sides if they differ.

        Both ranks issue the two ops in the same order (rank 0 sends first), which NCCL needs; for
        NCCL this also opens both directions of the lazy connection now, while both are alive."""
        mine = self.layout.to_ints().to(self.device)  # [NUM_INTS] int64
        theirs = torch.empty_like(mine)
        if pair.rank == 0:
            send = self._start(pair, "send", mine, TAG_LAYOUT)
            recv = self._start(pair, "recv", theirs, TAG_LAYOUT)
        else:
            recv = self._start(pair, "recv", theirs, TAG_LAYOUT)
            send = self._start(pair, "send", mine, TAG_LAYOUT)
        deadline = time.monotonic() + timeout_s
        if not recv.wait(timeout_s):
            raise TimeoutError(f"{pair.peer_id!r} did not send its KV layout within {timeout_s:.1f} s")
        mismatch: LayoutMismatchError | None = None
        try:
            self.layout.check_compatible(KvLayout.from_ints(theirs.cpu()))
        except LayoutMismatchError as e:
            mismatch = e
        # NOTE: wait for our own send even on a mismatch, so the peer gets our layout before the
        # release closes the connection; and a peer that closed first over the same mismatch must
        # still leave us reporting the mismatch, not the closed connection.
        try:
            is_sent = send.wait(deadline - time.monotonic())
        except TransferError:
            if mismatch is None:
                raise
            is_sent = True
        if mismatch is not None:
            raise mismatch
        if not is_sent:
            raise TimeoutError(f"{pair.peer_id!r} did not take our KV layout within {timeout_s:.1f} s")

    def send(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        self._check_tensor(peer_id, tensor)
        return self._start(self._get(peer_id), "send", _on_the_wire(tensor), TAG_DATA)

    def recv(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        self._check_tensor(peer_id, tensor)
        return self._start(self._get(peer_id), "recv", _on_the_wire(tensor), TAG_DATA)

    def drop(self, peer_id: str) -> None:
        with self._lock:
            pair = self._pairs.pop(peer_id, None)
        if pair is not None:
            self._release(pair)

    def is_paired(self, peer_id: str) -> bool:
        with self._lock:
            return peer_id in self._pairs

    def close(self, timeout_s: float = 2.0) -> None:
        """Drop every pair, then wait up to `timeout_s` for their threads to finish.

        NOTE: the only call here that waits: a process that exits while a gloo thread is still
        inside a wait() dies with "terminate called without an active exception" (torch 2.13)."""
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            self._release(pair)
        deadline = time.monotonic() + timeout_s
        for pair in pairs:
            for thread in list(pair.threads):
                thread.join(max(0.0, deadline - time.monotonic()))
        self._rendezvous.close()

    def _get(self, peer_id: str) -> Pair:
        with self._lock:
            pair = self._pairs.get(peer_id)
        if pair is None:
            raise ValueError(f"{self.self_id!r} is not paired with {peer_id!r} over {self.name}; call pair() first")
        return pair

    def _release(self, pair: Pair) -> None:
        """Mark dropped (unfinished handles fail) and abort the group off this thread: never blocks."""
        with pair.lock:
            if pair.is_dropped:
                return
            pair.is_dropped = True
            waiters = list(pair.waiters.values())
            pair.waiters.clear()  # no Pair <-> Waiter cycle: the group is freed once the waiters exit
        for waiter in waiters:
            waiter.stop()
        abort = threading.Thread(target=self._abort, args=(pair,), name=f"kvtransfer-abort-{pair.peer_id}", daemon=True)
        pair.threads.append(abort)
        abort.start()

    def _explain(self, pair: Pair, error: BaseException) -> TransferError:
        if pair.is_dropped:
            return TransferError(f"{self.self_id!r} dropped its pair with {pair.peer_id!r} ({error})")
        return TransferError(f"the pair with {pair.peer_id!r} broke: the peer dropped it or died ({error})")

    # -- backend hooks ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _form(self, peer_id: str, rank: int, prefix_store: dist.PrefixStore) -> Pair:
        """Build the pair's process group (blocking until both sides joined)."""

    @abc.abstractmethod
    def _start(self, pair: Pair, op: str, tensor: torch.Tensor, tag: int) -> TransferHandle:
        """Start a "send" or "recv" of `tensor` on the pair without blocking; a dropped pair or a
        failure to start gives a handle that is already failed."""

    @abc.abstractmethod
    def _abort(self, pair: Pair) -> None:
        """Tear the pair's group down; runs on a daemon thread and may block for a long time."""


def _on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 KV buffer as its bytes (a view: a recv lands in the buffer): gloo has no float8 type."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor
