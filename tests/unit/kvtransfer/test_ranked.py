"""kvtransfer.ranked without a group: which prefill rank sends which KV heads to which decode rank,
and a push's time on the device as rank 0's handle reports it (its own sends, the longest)."""

from __future__ import annotations

import pytest

from kvtransfer.ranked import Route, _RankHandle, routes
from kvtransfer.transport import EventHandle


class _Timed(EventHandle):
    def __init__(self, seconds: float | None) -> None:
        super().__init__("send")
        self.seconds = seconds
        self.finish()

    def device_seconds(self) -> float | None:
        return self.seconds


def test_each_decode_rank_gets_its_heads_from_the_ranks_that_hold_them() -> None:
    assert routes(8, 1, 1) == [Route(0, 0, 0, 8)]
    assert routes(8, 1, 2) == [Route(0, 0, 0, 4), Route(0, 1, 4, 8)]
    assert routes(8, 2, 1) == [Route(0, 0, 0, 4), Route(1, 0, 4, 8)]
    assert routes(8, 2, 2) == [Route(0, 0, 0, 4), Route(1, 1, 4, 8)]


@pytest.mark.parametrize(("own", "want"), [([0.004, 0.006], 0.006), ([0.004, None], None), ([], None)])
def test_a_push_s_device_time_is_rank_0_s_longest_send(own: list[float | None], want: float | None) -> None:
    handle = _RankHandle("KV push", [_Timed(s) for s in own], None, [])
    assert handle.wait(1.0) and handle.device_seconds() == want
