"""WorkerChannels: which worker handles a router replica reaches over the request channel, and
that a worker keeps one channel across the worker set's versions until it leaves."""

from __future__ import annotations

import asyncio

from kvtransfer.channel import ChannelHandle
from router import Dispatcher, Workers
from router.channels import WorkerChannels
from router.follow import WorkerSetFollower


class _Remote:
    """Stands in for a Ray actor handle."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_remote_handles_are_wrapped_and_share_one_channel_until_they_leave():
    channels = WorkerChannels(lambda h: isinstance(h, _Remote))
    d0, d1, p0 = _Remote("d0"), _Remote("d1"), _Remote("p0")
    first = channels.wrap(Workers(prefill={"p0": p0}, decode={"d0": d0, "d1": d1}))
    assert all(isinstance(h, ChannelHandle) for h in [*first.prefill.values(), *first.decode.values()])
    assert first.decode["d0"].name == "d0" and first.prefill["p0"].name == "p0"  # the rest is the actor's
    assert first.prefill["p0"]._refs is first.decode["d0"]._refs is channels.refs  # a handle pickled once a replica
    client0 = channels.clients["d0"]

    retiring = object()  # a retiring worker's stand-in (not a remote handle): used as it is
    second = channels.wrap(Workers(prefill={}, decode={"d0": d0, "d1": retiring}))
    assert second.decode["d1"] is retiring
    assert second.decode["d0"]._client is client0  # the same connection across versions
    assert set(channels.clients) == {"d0", "d1"}  # d1's channel stays: its poller still reads it

    assert set(channels.clients) == {"d0", "d1"}  # p0 left the set: its channel closed
    closed = []
    channels.clients["d1"].close = lambda: closed.append("d1")  # type: ignore[method-assign]
    channels.wrap(Workers(prefill={}, decode={"d0": d0}))
    assert closed == ["d1"] and set(channels.clients) == {"d0"}


def test_the_follower_hands_the_dispatcher_wrapped_sets():
    async def main():
        channels = WorkerChannels(lambda h: isinstance(h, _Remote))
        d0 = _Remote("d0")

        async def fetch():
            return 1, {}, {"d0": d0}

        dispatcher = Dispatcher("r", Workers({}, {}))
        follower = WorkerSetFollower(dispatcher, fetch, interval_s=60, wrap=channels.wrap)
        await follower.start()
        assert isinstance(dispatcher.workers.decode["d0"], ChannelHandle)
        follower.stop()
        await dispatcher.close()
        channels.close()

    asyncio.run(main())
