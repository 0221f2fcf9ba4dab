"""Arrival processes and the runner, without a server: Poisson and gamma gaps (mean rate, burstiness),
seeds, the concurrency limit, the arrival schedule, the duration cap, and the progress bar."""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import statistics

import pytest

from loadgen import BenchRequest, RequestRecord, arrival_offsets
from loadgen.runner import Progress, run_requests


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    rate, n = 5.0, 20_000
    offsets = arrival_offsets(n, rate, seed=1)
    gaps = _gaps(offsets)
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert (n - 1) / offsets[-1] == pytest.approx(rate, rel=0.03)
    mean = statistics.fmean(gaps)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness: float) -> None:
    rate, n = 5.0, 20_000
    gaps = _gaps(arrival_offsets(n, rate, burstiness=burstiness, seed=2))
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)  # 2 for bursty 0.25, 0.5 for steady 4


def test_seeds_and_infinite_rate() -> None:
    assert arrival_offsets(50, 3.0, seed=7) == arrival_offsets(50, 3.0, seed=7)
    assert arrival_offsets(50, 3.0, seed=7) != arrival_offsets(50, 3.0, seed=8)
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_offsets(4, 0.0)
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_offsets(4, 1.0, burstiness=0.0)


class _FakeServer:
    """A SendFn that takes LATENCY_S per request and counts how many are in flight."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.num_in_flight = self.max_in_flight = 0
        self.send_times: dict[int, float] = {}

    async def send(self, index: int, request: BenchRequest, origin: float) -> RequestRecord:
        loop = asyncio.get_running_loop()
        send_time = loop.time() - origin
        self.send_times[index] = send_time
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.num_in_flight -= 1
        end = loop.time() - origin
        return RequestRecord(index, request.max_tokens, send_time, end, (end,), prompt_tokens=1,
                             completion_tokens=request.max_tokens, is_success=True, http_status=200)


def _run(server: _FakeServer, num: int, offsets: list[float], **kwargs) -> object:
    async def go():
        clock = asyncio.get_running_loop().time
        return await run_requests([BenchRequest([1, 2], 1)] * num, offsets, server.send, clock=clock, **kwargs)

    return asyncio.run(go())


def test_concurrency_limit_is_honoured() -> None:
    server = _FakeServer(latency_s=0.05)
    result = _run(server, 12, [0.0] * 12, max_concurrency=3)
    assert server.max_in_flight == 3 and server.num_in_flight == 0
    assert len(result.records) == 12 and result.num_not_sent == 0 and not result.is_capped
    assert [r.index for r in result.records] == list(range(12))
    assert result.duration_s >= 4 * 0.05  # 12 requests, 3 at a time


def test_requests_leave_on_their_arrival_schedule() -> None:
    server = _FakeServer(latency_s=0.01)
    offsets = arrival_offsets(8, 40.0, seed=3)
    _run(server, 8, offsets)
    for index, offset in enumerate(offsets):
        assert offset <= server.send_times[index] <= offset + 0.05


def test_duration_cap_cancels_in_flight_and_reconciles() -> None:
    server = _FakeServer(latency_s=5.0)
    offsets = [0.1 * i for i in range(10)]  # 0, 0.1, 0.2 are before the cap
    result = _run(server, 10, offsets, duration=0.25)
    assert result.is_capped and len(result.records) == 3 and result.num_not_sent == 7
    assert all(not r.is_success and "duration cap" in r.error for r in result.records)
    assert 0.25 <= result.duration_s < 1.0 and server.num_in_flight == 0


def test_progress_bar_lines() -> None:
    stream = io.StringIO()  # not a terminal: a line each tenth of the run
    progress = Progress(4, label="2 req/s", stream=stream)
    for i in range(4):
        progress.update(RequestRecord(i, 1, 0.0, 0.1, is_success=i != 2, chunk_times=(0.1,), completion_tokens=1))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("2 req/s [" + "#" * 30 + "] 4/4 done, 1 errors")
    quiet = io.StringIO()
    Progress(4, stream=quiet, is_enabled=False).update(RequestRecord(0, 1, 0.0, 0.1))
    assert quiet.getvalue() == ""
