"""bench.adaptive_report: attainment re-scored from per-request records under each SLO pair, goodput as the
highest rate of an unbroken run at >= 90%, the 90% crossing between two rates; and the committed report
recomputes from the committed runs."""

from __future__ import annotations

import json

import pytest

from bench.adaptive_report import RESULTS, attainment_rows, goodput, report


def _rec(ttft: float, tpot: float | None, ok: bool = True) -> dict:
    return {"ok": ok, "ttft_ms": ttft if ok else None, "tpot_ms": tpot}


def test_requests_are_scored_against_both_slos_and_failures_count_as_missed():
    run = {"requests": {"m": [{"rate": 2.0, "records": [_rec(100, 10), _rec(900, 39), _rec(1100, 10), _rec(100, 41),
                                                        _rec(0, None, ok=False), _rec(50, None)]}]}}
    # met: the first two and the one-token answer (no TPOT); missed: late, slow, failed
    assert attainment_rows(run, "m", 1000, 40) == [{"rate": 2.0, "attainment": 0.5, "num_requests": 6,
                                                     "ci95": [0.1876, 0.8124]}]
    assert attainment_rows(run, "m", 1000, 20)[0]["attainment"] == pytest.approx(2 / 6)


def test_goodput_is_the_last_rate_of_the_unbroken_run_at_90_percent():
    rows = [{"rate": r, "attainment": a} for r, a in ((4, 1.0), (8, 0.95), (12, 0.5), (16, 0.95))]
    best, crossing, fell = goodput(rows)
    assert best == 8 and fell and crossing == pytest.approx(8 + 4 * (0.05 / 0.45))
    assert goodput([{"rate": 4, "attainment": 0.8}]) == (None, None, True)
    assert goodput([{"rate": 4, "attainment": 0.95}]) == (4, None, False)


@pytest.mark.parametrize("name", ["adaptive_2xh200", "decode_heavy_2xh200", "tp70b_4xh200", "fp8_70b_2xh200",
                                  "fp8_70b_4xh200"])
def test_the_committed_report_recomputes_from_the_committed_runs(name: str):
    committed = json.loads((RESULTS / f"{name}.json").read_text())
    assert json.loads(json.dumps(report(RESULTS, name))) == committed  # NOTE: through JSON: tuples become lists


def test_each_rate_s_attainment_carries_its_95_percent_interval():
    from bench.adaptive_report import wilson_interval

    lo, hi = wilson_interval(40, 45)  # 89% of 45 requests
    assert lo == pytest.approx(0.766, abs=0.002) and hi == pytest.approx(0.952, abs=0.002)
    assert wilson_interval(45, 45)[1] == 1.0 and wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    run = {"requests": {"m": [{"rate": 3.0, "records": [_rec(100, 10)] * 40 + [_rec(2000, 10)] * 5}]}}
    assert attainment_rows(run, "m", 1000, 40)[0]["ci95"] == list(wilson_interval(40, 45))
