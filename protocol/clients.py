"""One client per worker kind: `DecodeClient` (DecodeAPI) and `PrefillClient` (PrefillAPI). A client
wraps its worker's target, a Ray actor handle or (in-process, in tests) the worker object itself,
and, once given one (`with_channel`), the request channel to it: the calls every request makes
(submit, prefill_locally, reserve, prefill, abort) and the token batches go over the channel, the
rest (stats, the prefix cache's changes, pairing, the KV hand-off between workers) to the target.
Callers never see which. It encodes the typed messages going out and decodes those coming back.
`invoke` is the one way a target's method is called.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from kvtransfer.ranked import RankTable
from protocol.api import CacheDeltaMsg, WorkerStatsMsg
from protocol.channel import Call, ChannelAddress, ChannelClient, Refs
from protocol.messages import (
    GenerateRequestMsg,
    KvAcceptMsg,
    KvReadyMsg,
    LeaseMsg,
    LocalPrefillMsg,
    LocalPrefillReplyMsg,
    PrefillResultMsg,
    PrefillTaskMsg,
    ReserveMsg,
    TokenBatchMsg,
)

C = TypeVar("C", bound="WorkerClient")


async def invoke(method: Any, *args: Any) -> Any:
    """Calls a target's method: a Ray actor method (`.remote`) or a coroutine function."""
    remote = getattr(method, "remote", None)
    return await (remote(*args) if remote is not None else method(*args))


class WorkerClient:
    def __init__(self, worker_id: str, target: Any, channel: ChannelClient | None = None,
                 refs: Refs | None = None) -> None:
        self.worker_id = worker_id
        self.target = target  # a Ray actor handle, or the worker itself in-process
        self.channel = channel
        self.refs = refs  # how a call over the channel names another worker (made on first need)

    def with_channel(self: C, channel: ChannelClient, refs: Refs) -> C:
        """The same worker, its per-request calls and token batches over `channel`."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__, channel=channel, refs=refs)
        return twin

    async def _hot(self, call: Call, name: str, *args: Any) -> Any:
        if self.channel is not None:
            return await self.channel.call(call, *args)
        return await invoke(getattr(self.target, name), *args)

    async def abort(self, request_id: str) -> bool:
        return await self._hot(Call.ABORT, "abort", request_id)

    async def stats(self) -> WorkerStatsMsg:
        return await invoke(self.target.stats)

    async def cache_delta(self, epoch: str, cursor: int) -> CacheDeltaMsg:
        """What the worker's prefix cache stored and removed since (epoch, cursor), or a snapshot of it."""
        return CacheDeltaMsg(**await invoke(self.target.cache_delta, epoch, cursor))

    async def health(self) -> bool:
        return await invoke(self.target.health)

    async def check_integrity(self) -> int:
        return await invoke(self.target.check_integrity)

    async def channel_address(self) -> ChannelAddress:
        return await invoke(self.target.channel_address)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_id!r}{', channel' if self.channel is not None else ''})"


class DecodeClient(WorkerClient):
    async def submit(self, request: GenerateRequestMsg) -> float:
        """Colocated: the whole request on this worker; returns when the call arrived there."""
        return await self._hot(Call.SUBMIT, "submit", request.encode())

    async def prefill_locally(self, local: LocalPrefillMsg) -> LocalPrefillReplyMsg:
        return LocalPrefillReplyMsg.decode(await self._hot(Call.PREFILL_LOCALLY, "prefill_locally", local.encode()))

    async def reserve(self, request: ReserveMsg) -> LeaseMsg | None:
        lease = await self._hot(Call.RESERVE, "reserve", request.encode())
        return None if lease is None else LeaseMsg.decode(lease)

    async def next_batch(self, router_id: str, timeout_s: float) -> TokenBatchMsg:
        """The next batch of this router's rows; an empty one after `timeout_s` of nothing. Over the
        channel, a caller that stops waiting (its deadline) drops the connection: a worker quiet that
        long is treated as failed, and its pusher must not keep taking this router's rows."""
        if self.channel is None:
            return TokenBatchMsg.decode(await invoke(self.target.poll, router_id, timeout_s))
        try:
            return TokenBatchMsg.decode(await self.channel.next_batch(router_id, timeout_s))
        except asyncio.CancelledError:
            self.channel.reset()
            raise

    async def kv_incoming(self, ready: KvReadyMsg) -> KvAcceptMsg:
        return KvAcceptMsg.decode(await invoke(self.target.kv_incoming, ready.encode()))

    async def transport_address(self) -> RankTable:
        """Where each of the worker's ranks pairs (kvtransfer/ranked.py)."""
        return RankTable.from_wire(await invoke(self.target.transport_address))

    async def accept_pair(self, prefill_worker_id: str, prefill: RankTable) -> None:
        await invoke(self.target.accept_pair, prefill_worker_id, prefill.to_wire())

    async def drain(self) -> None:
        await invoke(self.target.drain)


class RetiringDecodeClient(DecodeClient):
    """A retiring decode worker as routers see it while it drains: its stream, aborts and the KV
    hand-off reach it as before, but it takes no new request (no room, declined)."""

    async def reserve(self, request: ReserveMsg) -> LeaseMsg | None:
        return None

    async def prefill_locally(self, local: LocalPrefillMsg) -> LocalPrefillReplyMsg:
        return LocalPrefillReplyMsg(accepted=False, reason=f"decode worker {self.worker_id} is retiring")


class PrefillClient(WorkerClient):
    async def prefill(self, task: PrefillTaskMsg, decode: DecodeClient) -> PrefillResultMsg:
        """The one call of a disaggregated request: answered with its first token; the KV then goes
        to `decode` (named to the worker by its target)."""
        if self.channel is not None:
            if self.refs is None:
                self.refs = Refs()
            answer = await self.channel.call(Call.PREFILL, task.encode(), self.refs.encode(decode.target))
        else:
            answer = await invoke(self.target.prefill, task.encode(), decode.target)
        return PrefillResultMsg.decode(answer)


__all__ = ["DecodeClient", "PrefillClient", "RetiringDecodeClient", "WorkerClient", "invoke"]
