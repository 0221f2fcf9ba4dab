"""The load generator's metric math on hand-built timings: exact percentiles, TPOT, ITL, goodput under
SLOs, reconciliation, and the self-checks that refuse a record or metrics that contradict themselves."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen import (
    SLO,
    MetricsError,
    RecordError,
    RequestRecord,
    check_metrics,
    check_record,
    compute_metrics,
    percentile,
)

DURATION_S = 4.0


def _records() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, E2E 500 ms, TPOT (500 - 100) / 3 ms, ITL 100, 100, 100 ms
        RequestRecord(0, 4, 0.0, 0.5, (0.1, 0.2, 0.3, 0.4), prompt_tokens=10, completion_tokens=4, is_success=True,
                      http_status=200),
        # TTFT 300 ms, E2E 600 ms, TPOT 150 ms, ITL 50, 250 ms
        RequestRecord(1, 3, 1.0, 1.6, (1.3, 1.35, 1.6), prompt_tokens=20, completion_tokens=3, is_success=True,
                      http_status=200),
        # one token (asked 4): TTFT = E2E = 200 ms, no TPOT (0 for goodput), no ITL
        RequestRecord(2, 4, 2.0, 2.2, (2.2,), prompt_tokens=5, completion_tokens=1, is_success=True, http_status=200),
        RequestRecord(3, 4, 3.0, 3.1, http_status=503, error="overloaded"),
    ]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([100.0, 200.0, 300.0], 90) == pytest.approx(280.0)
    assert percentile([100.0, 200.0, 300.0], 99) == pytest.approx(298.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="p must be in"):
        percentile([1.0], 101)


def test_per_request_ttft_tpot_itl_e2e() -> None:
    r0, r1, r2, _ = _records()
    assert (r0.ttft, r0.e2e) == pytest.approx((0.1, 0.5))
    assert r0.tpot == pytest.approx(0.4 / 3)
    assert r0.itls == pytest.approx([0.1, 0.1, 0.1])
    assert r1.tpot == pytest.approx(0.15) and r1.itls == pytest.approx([0.05, 0.25])
    assert r2.tpot is None and r2.itls == [] and r2.ttft == pytest.approx(r2.e2e)


def test_metrics_exact_on_known_timings() -> None:
    m = compute_metrics(_records(), DURATION_S)
    assert (m.num_sent, m.num_completed, m.num_errored, m.num_good) == (4, 3, 1, None)
    assert m.num_off_length == 1  # request 2: 1 token of 4
    assert (m.total_prompt_tokens, m.total_completion_tokens) == (35, 8)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_token_throughput == pytest.approx(8 / 4)
    assert m.total_token_throughput == pytest.approx(43 / 4)
    assert m.goodput is None
    t = m.ttft_ms  # [100, 300, 200]
    assert (t.count, t.mean, t.median, t.p90, t.p99, t.max) == pytest.approx((3, 200, 200, 280, 298, 300))
    e = m.e2e_ms  # [500, 600, 200]
    assert (e.mean, e.median, e.p90, e.p99) == pytest.approx((1300 / 3, 500, 580, 598))
    p = m.tpot_ms  # [400/3, 150]: only requests of more than one token
    assert p.count == 2
    assert (p.mean, p.median, p.p90, p.p99) == pytest.approx(((400 / 3 + 150) / 2, (400 / 3 + 150) / 2,
                                                              400 / 3 + 0.9 * (150 - 400 / 3),
                                                              400 / 3 + 0.99 * (150 - 400 / 3)))
    i = m.itl_ms  # every gap: [100, 100, 100, 50, 250]
    assert (i.count, i.mean, i.median, i.p90, i.p99, i.max) == pytest.approx((5, 120, 100, 190, 244, 250))
    assert m.errors == {"503: overloaded": 1}
    check_metrics(m, _records())


@pytest.mark.parametrize(("slo", "num_good"), [
    (SLO(ttft_ms=250, tpot_ms=140), 2),  # 0 (100 ms, 133 ms) and 2 (200 ms, TPOT 0); 1 misses TTFT
    (SLO(ttft_ms=150), 1),  # only request 0
    (SLO(tpot_ms=145), 2),  # 0 and 2 (a one-token request meets any TPOT SLO); 1 has 150 ms
    (SLO(ttft_ms=301, tpot_ms=151), 3),
    (SLO(ttft_ms=50), 0),
])
def test_goodput_counts_requests_meeting_every_slo(slo: SLO, num_good: int) -> None:
    m = compute_metrics(_records(), DURATION_S, slo)
    assert m.num_good == num_good
    assert m.goodput == pytest.approx(num_good / DURATION_S)


def test_slo_bounds_are_inclusive() -> None:
    exact = RequestRecord(0, 3, 0.0, 0.75, (0.25, 0.5), completion_tokens=3, is_success=True)  # binary-exact times
    assert SLO(ttft_ms=250, tpot_ms=250).is_met(exact)
    assert not SLO(ttft_ms=249.9).is_met(exact) and not SLO(tpot_ms=249.9).is_met(exact)


def test_no_completed_request_gives_empty_stats() -> None:
    records = [RequestRecord(0, 4, 0.0, 0.1, http_status=None, error="ClientConnectorError")]
    m = compute_metrics(records, 1.0, SLO(ttft_ms=100))
    assert (m.num_sent, m.num_completed, m.num_errored, m.num_good, m.goodput) == (1, 0, 1, 0, 0.0)
    assert m.ttft_ms.count == 0 and m.ttft_ms.p99 is None
    assert m.errors == {"no HTTP status: ClientConnectorError": 1}
    check_metrics(m, records)


def test_bad_record_is_refused() -> None:
    ttft_after_end = RequestRecord(7, 2, 1.0, 1.5, (1.6,), completion_tokens=1, is_success=True)
    with pytest.raises(RecordError, match=r"request 7: TTFT 600\.000 ms > E2E 500\.000 ms"):
        check_record(ttft_after_end)
    with pytest.raises(RecordError, match="request 7"):
        compute_metrics([*_records(), ttft_after_end], DURATION_S)
    with pytest.raises(RecordError, match="before send_time"):
        check_record(RequestRecord(1, 2, 1.0, 1.5, (0.9, 1.2), completion_tokens=2, is_success=True))
    with pytest.raises(RecordError, match=r"chunk 2 .* arrived before chunk 1"):
        check_record(RequestRecord(1, 3, 0.0, 1.0, (0.1, 0.5, 0.4), completion_tokens=3, is_success=True))
    with pytest.raises(RecordError, match="last chunk"):
        check_record(RequestRecord(1, 3, 0.0, 1.0, (0.1, 0.5, 1.4), completion_tokens=3, is_success=True))
    with pytest.raises(RecordError, match="no token chunk"):
        check_record(RequestRecord(1, 3, 0.0, 1.0, (), completion_tokens=3, is_success=True))
    with pytest.raises(RecordError, match="completion_tokens=0"):
        check_record(RequestRecord(1, 3, 0.0, 1.0, (0.5,), completion_tokens=0, is_success=True))
    with pytest.raises(RecordError, match="end_time"):
        check_record(RequestRecord(1, 3, 2.0, 1.0, error="x"))


def test_check_metrics_catches_metrics_that_disagree_with_records() -> None:
    records = _records()
    m = compute_metrics(records, DURATION_S)
    with pytest.raises(MetricsError, match="counts do not reconcile"):
        check_metrics(dataclasses.replace(m, num_errored=0), records)
    with pytest.raises(MetricsError, match="counts do not reconcile"):
        check_metrics(m, records[:3])
    with pytest.raises(MetricsError, match="output_token_throughput"):
        check_metrics(dataclasses.replace(m, output_token_throughput=2.5), records)
    with pytest.raises(MetricsError, match="token totals"):
        check_metrics(dataclasses.replace(m, total_completion_tokens=9), records)
    with pytest.raises(MetricsError, match="shorter than the requests' span"):
        check_metrics(compute_metrics(records, 2.0), records)  # the records span 0.0 .. 3.1 s
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        compute_metrics(records, 0.0)


def test_record_json_round_trip() -> None:
    for r in _records():
        assert RequestRecord.from_json(r.to_json()) == r
