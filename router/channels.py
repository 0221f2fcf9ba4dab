"""WorkerChannels: a router replica's request channels (protocol/channel.py), one per worker
(prefill, decode or colocated), kept across the worker set's versions so that every version's
client of a worker shares one connection. It gives the clients whose target is remote (`is_remote`:
a Ray actor handle, in a replica) their channel, leaves in-process ones as they are, and closes a
worker's channel once the worker has left the set and its calls under way have answered. Knows
nothing of Ray or of how the set is made."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from protocol.channel import ChannelClient, Refs
from protocol.clients import WorkerClient
from router.dispatch import Workers

C = TypeVar("C", bound=WorkerClient)


class WorkerChannels:
    def __init__(self, is_remote: Callable[[Any], bool], connect_timeout_s: float = 10.0) -> None:
        self.is_remote = is_remote
        self.connect_timeout_s = connect_timeout_s
        self.clients: dict[str, ChannelClient] = {}  # worker id -> its channel
        self.refs = Refs()  # the decode workers' handles as a prefill call names them, pickled once

    def wrap(self, workers: Workers) -> Workers:
        """The same set, its remote workers' clients over their channels."""
        wrapped = Workers(prefill=self._wrap(workers.prefill), decode=self._wrap(workers.decode))
        for worker_id in set(self.clients) - set(workers.prefill) - set(workers.decode):
            self.clients.pop(worker_id).close_when_idle()  # NOTE: a worker rejoining later gets a new channel
        return wrapped

    def _wrap(self, clients: Mapping[str, C]) -> dict[str, C]:
        out: dict[str, C] = {}
        for worker_id, client in clients.items():
            if not self.is_remote(client.target):
                out[worker_id] = client
                continue
            channel = self.clients.get(worker_id)
            if channel is None:
                channel = self.clients[worker_id] = ChannelClient(worker_id, client.channel_address,
                                                                  self.connect_timeout_s)
            out[worker_id] = client.with_channel(channel, self.refs)
        return out

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()
