"""What crosses a process boundary between routers and workers: the typed messages with their
msgpack encoding (`protocol.messages`), the request channel (`protocol.channel`: a direct socket from
a router to each worker), the worker interfaces (`protocol.api`: PrefillAPI, DecodeAPI, WorkerStatsMsg)
and one client per worker kind that hides whether a call goes over the channel or Ray
(`protocol.clients`). It knows nothing of how workers compute, where they run, or how a router picks
them; it moves no KV (kvtransfer/ does)."""

from protocol.api import DecodeAPI, PrefillAPI, WorkerStatsMsg
from protocol.clients import DecodeClient, PrefillClient, RetiringDecodeClient, WorkerClient, invoke

__all__ = [
    "DecodeAPI", "DecodeClient", "PrefillAPI", "PrefillClient", "RetiringDecodeClient", "WorkerClient",
    "WorkerStatsMsg", "invoke",
]
