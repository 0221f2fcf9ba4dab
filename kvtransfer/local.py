"""The in-process transport: colocated workers and unit tests move KV through a shared LocalHub.

The hub is passed to every LocalTransport that should see the others (there is no module-level
hub); it holds the pairing rendezvous and, per pair, one FIFO channel in each direction.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvtransfer.layout import KvLayout
from kvtransfer.transport import EventHandle, PairAddress, TransferError, TransferHandle, Transport, register_transport

__all__ = ["LocalHub", "LocalTransport"]


@dataclass
class _Channel:
    """One direction (src -> dst) of one pair generation. Invariant: `messages` and `recvs` are never
    both non-empty: a send meets the oldest waiting recv, else it queues (and vice versa)."""

    what: str  # "a -> b", for error messages
    messages: deque[torch.Tensor] = field(default_factory=deque)  # clones owned by the channel
    recvs: deque[tuple[torch.Tensor, EventHandle]] = field(default_factory=deque)
    closed_by: str | None = None


@dataclass
class _Meeting:
    layouts: dict[int, KvLayout]  # rank -> layout of the side that arrived
    channels: tuple[_Channel, _Channel] | None = None  # (host -> joiner, joiner -> host) once both came


class LocalHub:
    """Rendezvous and channels shared by the LocalTransports of one process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # guards every meeting and channel of this hub
        self._meetings: dict[tuple[str, str], _Meeting] = {}  # (host id, joiner id) -> meeting

    def meet(self, host_id: str, joiner_id: str, rank: int, layout: KvLayout,
             timeout_s: float) -> tuple[KvLayout, tuple[_Channel, _Channel]]:
        """Wait for the other side of (host, joiner); return its layout and the pair's channels."""
        key = (host_id, joiner_id)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            meeting = self._meetings.get(key)
            if meeting is None:
                meeting = self._meetings[key] = _Meeting({rank: layout})
            elif rank in meeting.layouts:
                raise ValueError(f"{host_id!r} and {joiner_id!r} are already pairing as rank {rank}")
            else:
                meeting.layouts[rank] = layout
                meeting.channels = (_Channel(f"{host_id} -> {joiner_id}"), _Channel(f"{joiner_id} -> {host_id}"))
                del self._meetings[key]
                self._cond.notify_all()
            while meeting.channels is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    del self._meetings[key]  # still ours: only the second arrival removes a meeting
                    peer = joiner_id if rank == 0 else host_id
                    raise TimeoutError(f"{peer!r} did not pair within {timeout_s} s")
                self._cond.wait(remaining)
            return meeting.layouts[1 - rank], meeting.channels

    def put(self, channel: _Channel, tensor: torch.Tensor, handle: EventHandle) -> None:
        with self._cond:
            if channel.closed_by is not None:
                handle.finish(TransferError(f"pair {channel.what} was dropped by {channel.closed_by!r}"))
            elif channel.recvs:
                buf, recv_handle = channel.recvs.popleft()
                recv_handle.finish(_copy_into(buf, tensor, channel.what))
                handle.finish()
            else:
                channel.messages.append(tensor.clone())
                handle.finish()  # the channel owns a copy: the sender may reuse its buffer now

    def take(self, channel: _Channel, buf: torch.Tensor, handle: EventHandle) -> None:
        with self._cond:
            if channel.closed_by is not None:
                handle.finish(TransferError(f"pair {channel.what} was dropped by {channel.closed_by!r}"))
            elif channel.messages:
                handle.finish(_copy_into(buf, channel.messages.popleft(), channel.what))
            else:
                channel.recvs.append((buf, handle))

    def close(self, channels: tuple[_Channel, ...], by: str) -> None:
        """Close channels for both sides; recvs still waiting fail."""
        with self._cond:
            for channel in channels:
                if channel.closed_by is None:
                    channel.closed_by = by
                channel.messages.clear()
                while channel.recvs:
                    channel.recvs.popleft()[1].finish(TransferError(f"pair {channel.what} was dropped by {by!r}"))


def _copy_into(buf: torch.Tensor, message: torch.Tensor, what: str) -> TransferError | None:
    if buf.shape != message.shape or buf.dtype != message.dtype:
        return TransferError(f"{what}: sent {tuple(message.shape)} {message.dtype}, "
                             f"but the receive buffer is {tuple(buf.shape)} {buf.dtype}")
    buf.copy_(message)
    return None


@register_transport
class LocalTransport(Transport):
    """Transfers between workers of one process, through the LocalHub they share.

    A send clones the tensor into the channel (so it finishes at once); a recv copies the oldest
    unread message into its buffer, or waits for the next send.
    """

    name = "local"
    supports_cpu = True
    supports_cuda = True

    def __init__(self, self_id: str, layout: KvLayout, device: torch.device | str, hub: LocalHub) -> None:
        super().__init__(self_id, layout, device)
        self._hub = hub
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[_Channel, _Channel]] = {}  # peer -> (outgoing, incoming)

    def address(self) -> PairAddress:
        return PairAddress(host=f"local:{self.self_id}", port=0)

    def pair(self, peer_id: str, address: PairAddress, rank: int, timeout_s: float) -> None:
        self._check_rank(rank)
        host_id, joiner_id = (self.self_id, peer_id) if rank == 0 else (peer_id, self.self_id)
        peer_layout, (to_joiner, to_host) = self._hub.meet(host_id, joiner_id, rank, self.layout, timeout_s)
        # NOTE: both sides compare the same two layouts, so both raise or neither does.
        self.layout.check_compatible(peer_layout)
        channels = (to_joiner, to_host) if rank == 0 else (to_host, to_joiner)
        with self._lock:
            old = self._pairs.pop(peer_id, None)
            self._pairs[peer_id] = channels
        if old is not None:
            self._hub.close(old, by=self.self_id)

    def send(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        self._check_tensor(peer_id, tensor)
        handle = EventHandle(f"send to {peer_id!r}")
        self._hub.put(self._channels(peer_id)[0], tensor, handle)
        return handle

    def recv(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        self._check_tensor(peer_id, tensor)
        handle = EventHandle(f"recv from {peer_id!r}")
        self._hub.take(self._channels(peer_id)[1], tensor, handle)
        return handle

    def drop(self, peer_id: str) -> None:
        with self._lock:
            channels = self._pairs.pop(peer_id, None)
        if channels is not None:
            self._hub.close(channels, by=self.self_id)

    def is_paired(self, peer_id: str) -> bool:
        with self._lock:
            return peer_id in self._pairs

    def close(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            peers = list(self._pairs)
        for peer_id in peers:
            self.drop(peer_id)

    def _channels(self, peer_id: str) -> tuple[_Channel, _Channel]:
        with self._lock:
            channels = self._pairs.get(peer_id)
        if channels is None:
            raise ValueError(f"{self.self_id!r} is not paired with {peer_id!r}; call pair() first")
        return channels
