"""bench.rate_step without servers: the schedule's arrivals, and the score of a rate step (windows by
send time, transitions after each change of rate, attainment outside them, lost requests)."""

from __future__ import annotations

import pytest

from bench.rate_step import arrivals, parse_schedule, score


def test_a_schedule_s_arrivals_follow_its_rates():
    schedule = parse_schedule("4:60,16:60,4:60")
    assert schedule == ((4.0, 60.0), (16.0, 60.0), (4.0, 60.0))
    times = arrivals(schedule, seed=1)
    counts = [sum(a <= t < a + 60 for t in times) for a in (0, 60, 120)]
    assert all(abs(c - 60 * r) < 4 * (60 * r) ** 0.5 for c, (r, _) in zip(counts, schedule))  # within 4 sigma
    assert times == sorted(times) and times[-1] < 180
    assert arrivals(schedule, seed=1) == times  # seeded
    for bad in ("4", "4:0", "x:60", ""):
        with pytest.raises(ValueError, match="--schedule"):
            parse_schedule(bad)


def _record(send_s: float, good: bool) -> dict:
    return {"send_s": send_s, "ok": True, "ttft_ms": 100.0 if good else 5000.0, "tpot_ms": 10.0}


def test_a_transition_lasts_until_every_later_window_of_its_segment_holds():
    schedule = ((1.0, 40.0), (4.0, 40.0))
    records = [_record(t, True) for t in range(0, 40)]  # first segment all good
    records += [_record(40 + i * 0.25, 40 + i * 0.25 >= 60) for i in range(160)]  # bad for 20 s after the step
    result = score(records, schedule, ttft_ms=1000, tpot_ms=40, num_planned=len(records))
    assert [t["seconds"] for t in result["transitions"]] == [20.0]
    assert result["attainment_outside_transitions"] == 1.0 and result["is_met"] and result["num_lost"] == 0
    # a dip later in the segment stretches the transition to it; past 30 s the run fails
    for r in records[-35:-29]:  # 6 of the 40 requests sent in 70-80 s: 85%
        r["ttft_ms"] = 5000.0
    worse = score(records, schedule, ttft_ms=1000, tpot_ms=40, num_planned=len(records))
    assert worse["transitions"][0]["seconds"] == 40.0 and not worse["is_met"]


def test_lost_requests_fail_the_run():
    records = [_record(t, True) for t in range(0, 20)]
    records[3]["ok"] = False
    result = score(records, ((1.0, 20.0),), ttft_ms=1000, tpot_ms=40, num_planned=21)
    assert result["num_lost"] == 2 and not result["is_met"] and result["transitions"] == []
