"""Pairs (prefill_worker/pairs.py) with a fake transport and decode worker: a handshake that fails
fails the ones that waited for the pair's lock meanwhile at once (not each after its own pair
timeout, holding its blocks), and handshakes queued after it try again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine import SamplingParams
from prefill_worker.pairs import Pairs, PushFailed
from protocol.messages import GenerateRequestMsg, KvAcceptMsg, KvReadyMsg

PAIR_TIMEOUT_S = 0.2


class _Transport:
    """The RankedKv calls Pairs makes; pairing hangs while `hangs` (a peer that cannot pair)."""

    def __init__(self) -> None:
        self.table = object()
        self.paired: set[str] = set()
        self.hangs = True
        self.attempts = 0

    def is_paired(self, peer_id: str) -> bool:
        return peer_id in self.paired

    async def pair_async(self, table: Any, sends: bool, timeout_s: float) -> None:
        self.attempts += 1
        if self.hangs:
            await asyncio.sleep(10 * timeout_s)  # NOTE: the caller's wait_for gives up first
        self.paired.add("decode-1")

    def drop(self, peer_id: str) -> None:
        self.paired.discard(peer_id)


class _Decode:
    worker_id = "decode-1"

    async def transport_address(self) -> object:
        return object()

    async def accept_pair(self, prefill_worker_id: str, table: Any) -> None:
        return None

    async def kv_incoming(self, ready: KvReadyMsg) -> KvAcceptMsg:
        return KvAcceptMsg(accepted=True)


def _ready(i: int) -> KvReadyMsg:
    request = GenerateRequestMsg(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                                 router_id="router-1")
    return KvReadyMsg(lease_id=f"l{i}", prefill_worker_id="prefill-1", request=request, first_token=4, num_blocks=1)


def test_a_failed_handshake_fails_those_that_waited_at_once_and_later_ones_try_again() -> None:
    transport = _Transport()
    pairs = Pairs(transport, "prefill-1", PAIR_TIMEOUT_S)  # type: ignore[arg-type]
    decode = _Decode()

    async def burst() -> list[BaseException | None]:
        async def one(i: int) -> BaseException | None:
            try:
                (await pairs.handshake(decode, _ready(i))).release()  # type: ignore[arg-type]
            except PushFailed as err:
                return err
            return None

        return await asyncio.gather(*(one(i) for i in range(5)))

    async def run() -> tuple[list[BaseException | None], float, list[BaseException | None]]:
        started = time.monotonic()
        failing = await burst()
        elapsed = time.monotonic() - started
        transport.hangs = False
        return failing, elapsed, await burst()

    failing, elapsed, later = asyncio.run(run())
    assert all(isinstance(o, PushFailed) and not o.decode_knows for o in failing), failing
    assert "while this one waited" in str(failing[1]) and "TimeoutError" in str(failing[1])
    # One pair timeout (and its extra second for the peer's own error), not five in turn.
    assert elapsed < 2 * (PAIR_TIMEOUT_S + 1.0), elapsed
    assert later == [None] * 5, "handshakes queued after the failure pair again"
    assert transport.attempts == 2, "the four that waited did not try to pair; the next burst paired once"


def test_a_cancelled_handshake_fails_none_of_those_that_wait() -> None:
    """A handshake cancelled while it pairs (its job aborted) is no failure of the pair: the one that
    waited behind it pairs."""
    transport = _Transport()
    pairs = Pairs(transport, "prefill-1", PAIR_TIMEOUT_S)  # type: ignore[arg-type]
    decode = _Decode()

    async def run() -> tuple[bool, BaseException | None]:
        first = asyncio.ensure_future(pairs.handshake(decode, _ready(0)))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)  # it holds the lock, pairing
        second = asyncio.ensure_future(pairs.handshake(decode, _ready(1)))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        first.cancel()
        transport.hangs = False
        try:
            await first
        except asyncio.CancelledError:
            pass
        try:
            (await second).release()
        except PushFailed as err:
            return first.cancelled(), err
        return first.cancelled(), None

    assert asyncio.run(run()) == (True, None)
    assert transport.attempts == 2
