"""bench.paired without Ray or devices: the rotating measurement order, the per-round overhead, and
the seeded bootstrap interval of its median."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from bench.paired import bootstrap_median_ci, overhead_summary, paired_overheads, rotation

MODES = ["colocated", "disaggregated", "third"]


def test_rotation_is_abc_bca_cab_then_repeats():
    orders = ["".join(rotation("ABC", i)) for i in range(7)]
    assert orders == ["ABC", "BCA", "CAB", "ABC", "BCA", "CAB", "ABC"]


@pytest.mark.parametrize("start", [0, 2, 5])
def test_rotation_puts_every_mode_at_every_position_equally_over_whole_cycles(start):
    num_rounds = 3 * len(MODES)
    positions = Counter((name, pos) for i in range(start, start + num_rounds) for pos, name in
                        enumerate(rotation(MODES, i)))
    assert positions == {(name, pos): 3 for name in MODES for pos in range(len(MODES))}
    assert all(sorted(rotation(MODES, i)) == sorted(MODES) for i in range(10))  # each mode once a round


def test_rotation_rejects_no_names():
    with pytest.raises(ValueError, match="no names"):
        rotation([], 0)


def test_paired_overheads_are_per_round_ratios():
    assert paired_overheads([1.1, 2.0, 0.9], [1.0, 2.0, 1.0]) == pytest.approx([0.1, 0.0, -0.1])


def test_paired_overhead_cancels_a_drift_that_the_ratio_of_medians_does_not():
    # The machine slows 0.4% a round; the mode is always 3% slower than the baseline at one instant.
    def drift(t: int) -> float:
        return 1.0 + 0.004 * t

    one_after_another = [1.03 * drift(t) for t in range(10, 20)], [drift(t) for t in range(10)]
    interleaved = [1.03 * drift(t) for t in range(10)], [drift(t) for t in range(10)]
    mode, baseline = one_after_another
    assert statistics.median(mode) / statistics.median(baseline) - 1 > 0.06  # the drift, not the effect
    assert statistics.median(paired_overheads(*interleaved)) == pytest.approx(0.03)


def test_paired_overheads_reject_unpaired_or_bad_baselines():
    with pytest.raises(ValueError, match="3 values against 2"):
        paired_overheads([1.0, 1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_overheads([1.0], [0.0])


def test_bootstrap_is_seeded_and_brackets_the_median():
    rng = random.Random(7)
    values = [0.05 + rng.gauss(0, 0.02) for _ in range(40)]
    low, high = bootstrap_median_ci(values, num_resamples=2000, seed=3)
    assert (low, high) == bootstrap_median_ci(values, num_resamples=2000, seed=3)  # same seed, same interval
    assert (low, high) != bootstrap_median_ci(values, num_resamples=2000, seed=4)
    assert min(values) <= low <= statistics.median(values) <= high <= max(values)
    assert high - low < 0.03  # 40 values of sd 0.02: the median's interval is about +-0.006


def test_bootstrap_interval_narrows_with_more_values():
    rng = random.Random(1)
    few = [rng.gauss(0, 1) for _ in range(10)]
    many = [rng.gauss(0, 1) for _ in range(400)]
    low_few, high_few = bootstrap_median_ci(few, num_resamples=1000)
    low_many, high_many = bootstrap_median_ci(many, num_resamples=1000)
    assert high_many - low_many < (high_few - low_few) / 2


def test_bootstrap_of_constant_values_is_that_value():
    assert bootstrap_median_ci([0.02] * 5, num_resamples=100) == (pytest.approx(0.02), pytest.approx(0.02))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"values": []}, "no values"), ({"num_resamples": 0}, "num_resamples"), ({"level": 1.0}, "level")],
)
def test_bootstrap_rejects_bad_arguments(kwargs, match):
    args = {"values": [1.0, 2.0], **kwargs}
    with pytest.raises(ValueError, match=match):
        bootstrap_median_ci(**args)


def test_overhead_summary_fields_follow_from_its_values():
    baseline = [0.050, 0.052, 0.051, 0.055, 0.049]
    mode = [0.052, 0.053, 0.053, 0.057, 0.051]
    summary = overhead_summary(mode, baseline, num_resamples=500, seed=11)
    assert summary["per_prompt"] == pytest.approx(paired_overheads(mode, baseline))
    assert summary["median"] == pytest.approx(statistics.median(summary["per_prompt"]))
    assert (summary["ci95_low"], summary["ci95_high"]) == bootstrap_median_ci(summary["per_prompt"], 500, 11)
    assert summary["ci95_low"] <= summary["median"] <= summary["ci95_high"]
    assert summary["num_resamples"] == 500 and summary["seed"] == 11
