"""WorkerChannels: a router replica's request channels (kvtransfer/channel.py), one per worker
(prefill, decode or colocated), kept across the worker set's versions so that every version's
handle of a worker shares one connection. It wraps the handles it is told to (`is_remote`: Ray
actor handles, in a replica) as ChannelHandles, leaves the others as they are (a retiring worker's
stand-in, in-process workers), and closes a worker's channel once the worker has left the set.
Knows nothing of Ray or of how the set is made."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvtransfer.channel import ChannelAddress, ChannelClient, ChannelHandle, Refs
from router.dispatch import Workers, invoke


class WorkerChannels:
    def __init__(self, is_remote: Callable[[Any], bool], connect_timeout_s: float = 10.0) -> None:
        self.is_remote = is_remote
        self.connect_timeout_s = connect_timeout_s
        self.clients: dict[str, ChannelClient] = {}  # worker id -> its channel
        self.refs = Refs()  # the decode workers' handles as a prefill call names them, pickled once

    def wrap(self, workers: Workers) -> Workers:
        """The same set, its workers' remote handles as ChannelHandles."""
        wrapped = Workers(prefill=self._wrap(workers.prefill), decode=self._wrap(workers.decode))
        # NOTE: a worker shown as another kind of handle (retiring) keeps its channel: its poller still reads it.
        for worker_id in set(self.clients) - set(workers.prefill) - set(workers.decode):
            self.clients.pop(worker_id).close()
        return wrapped

    def _wrap(self, handles: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for worker_id, handle in handles.items():
            if not self.is_remote(handle):
                out[worker_id] = handle
                continue
            client = self.clients.get(worker_id)
            if client is None:
                client = self.clients[worker_id] = ChannelClient(worker_id, _address_of(handle), self.connect_timeout_s)
            out[worker_id] = ChannelHandle(handle, client, self.refs)
        return out

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()


def _address_of(handle: Any) -> Callable[[], Awaitable[ChannelAddress]]:
    return lambda: invoke(handle.channel_address)
