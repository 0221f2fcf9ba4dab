"""kvtransfer.endpoint.wait_transfer: how it waits for a young transfer (at every turn of the event
loop, never a timed sleep: those wait whole milliseconds), its timeout and its failure message."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import TransferError
from kvtransfer.endpoint import wait_transfer
from kvtransfer.transport import EventHandle


class _DoneAfter(EventHandle):
    """Done on the n-th `done()` call (a transfer finishing while it is polled)."""

    def __init__(self, num_polls: int, error: BaseException | None = None) -> None:
        super().__init__("send to 'decode-0'")
        self.num_polls, self.polls, self.fail_with = num_polls, 0, error

    def done(self) -> bool:
        self.polls += 1
        if self.polls >= self.num_polls:
            self.finish(self.fail_with)
        return super().done()


def test_a_young_transfer_is_checked_at_every_turn_without_timed_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def recording(delay: float, *args: object) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", recording)
    handle = _DoneAfter(num_polls=50)
    assert asyncio.run(wait_transfer(handle, timeout_s=5.0)) is None
    assert handle.polls == 50
    assert sleeps and set(sleeps) == {0}, sleeps[:5]  # NOTE: a sleep(0.0001) would take ~1 ms (epoll)


def test_a_failed_transfer_says_why_and_a_stuck_one_times_out() -> None:
    failed = _DoneAfter(num_polls=3, error=TransferError("the pair was dropped"))
    assert asyncio.run(wait_transfer(failed, timeout_s=5.0)) == (
        "failed: send to 'decode-0' failed: the pair was dropped"
    )
    stuck = _DoneAfter(num_polls=10**9)
    assert asyncio.run(wait_transfer(stuck, timeout_s=0.05)) == "timed out after 0.05 s"
