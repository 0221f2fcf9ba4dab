"""WorkerChannels: which workers' clients a router replica gives the request channel, and that a
worker keeps one channel across the worker set's versions until it leaves (then the channel closes
once its calls under way answer: tests/unit/protocol/test_channel.py)."""

from __future__ import annotations

import asyncio

from protocol.clients import DecodeClient, PrefillClient, RetiringDecodeClient
from router import Dispatcher, Workers
from router.channels import WorkerChannels
from router.follow import WorkerSetFollower


class _Remote:
    """Stands in for a Ray actor handle."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_remote_workers_get_channels_and_share_one_until_they_leave():
    channels = WorkerChannels(lambda h: isinstance(h, _Remote))
    d0, d1, p0, local = _Remote("d0"), _Remote("d1"), _Remote("p0"), object()
    first = channels.wrap(Workers.of(prefill={"p0": p0}, decode={"d0": d0, "d1": d1, "l0": local}))
    assert isinstance(first.prefill["p0"], PrefillClient) and isinstance(first.decode["d0"], DecodeClient)
    assert first.decode["d0"].target is d0 and first.prefill["p0"].target is p0
    assert (first.decode["d0"].channel is channels.clients["d0"]
            and first.prefill["p0"].channel is channels.clients["p0"])
    assert first.prefill["p0"].refs is first.decode["d0"].refs is channels.refs  # a handle pickled once a replica
    assert first.decode["l0"].channel is None and "l0" not in channels.clients  # in-process: as it is
    channel0 = channels.clients["d0"]

    retiring = RetiringDecodeClient("d1", d1)  # what a pool shows of a retiring worker
    second = channels.wrap(Workers(prefill={}, decode={"d0": DecodeClient("d0", d0), "d1": retiring}))
    assert isinstance(second.decode["d1"], RetiringDecodeClient)  # still retiring, its stream over the channel
    assert second.decode["d1"].channel is channels.clients["d1"]
    assert second.decode["d0"].channel is channel0  # the same connection across versions
    assert set(channels.clients) == {"d0", "d1"}  # p0 (and l0) left the set: p0's channel closed

    closed = []
    channels.clients["d1"].close_when_idle = lambda: closed.append("d1")  # type: ignore[method-assign]
    channels.wrap(Workers.of(prefill={}, decode={"d0": d0}))
    assert closed == ["d1"] and set(channels.clients) == {"d0"}  # closed once its calls under way answer


def test_a_retiring_client_takes_no_new_request():
    async def main():
        retiring = RetiringDecodeClient("d1", object())
        from protocol.messages import GenerateRequestMsg, LocalPrefillMsg, ReserveMsg
        from engine import SamplingParams

        assert await retiring.reserve(ReserveMsg(request_id="r", num_prompt_tokens=3, router_id="x")) is None
        request = GenerateRequestMsg(request_id="r", prompt_token_ids=[1], params=SamplingParams(), router_id="x")
        reply = await retiring.prefill_locally(LocalPrefillMsg(request=request))
        assert not reply.accepted and "retiring" in reply.reason

    asyncio.run(main())


def test_the_follower_hands_the_dispatcher_sets_with_channels():
    async def main():
        channels = WorkerChannels(lambda h: isinstance(h, _Remote))
        d0 = _Remote("d0")

        async def fetch():
            return 1, {}, {"d0": d0}

        dispatcher = Dispatcher("r", Workers({}, {}))
        follower = WorkerSetFollower(dispatcher, fetch, interval_s=60, wrap=channels.wrap)
        await follower.start()
        assert dispatcher.workers.decode["d0"].channel is channels.clients["d0"]
        follower.stop()
        await dispatcher.close()
        channels.close()

    asyncio.run(main())
