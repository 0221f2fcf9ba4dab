"""Paired comparisons of modes measured side by side: the rotating order in which each round
measures them, each round's overhead of a mode over a baseline, and a seeded bootstrap confidence
interval of the median overhead.

Why paired: drift over a run (clocks, temperature, the machine's other load) moves every mode
measured in the same round alike, so a ratio taken within each round cancels it where a ratio of
two medians taken minutes apart does not.

Pure functions of their arguments (no Ray, no torch, no clock); the randomness is a seeded
`random.Random`, so a report is reproducible from its values.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from loadgen.metrics import percentile

__all__ = ["bootstrap_median_ci", "overhead_summary", "paired_overheads", "rotation"]

DEFAULT_NUM_RESAMPLES = 10_000
DEFAULT_SEED = 0


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order round `round_index` measures `names` in: the list rotated left by the round index
    (ABC, BCA, CAB, ABC ...), so over any len(names) consecutive rounds every name is measured
    once at every position."""
    if not names:
        raise ValueError("rotation of no names")
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def paired_overheads(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """values[i] / baseline[i] - 1 for every round i (both measured in round i)."""
    if len(values) != len(baseline):
        raise ValueError(f"paired values: {len(values)} values against {len(baseline)} baseline values")
    if any(b <= 0 for b in baseline):
        raise ValueError(f"baseline values must be positive, got min {min(baseline)}")
    return [v / b - 1 for v, b in zip(values, baseline)]


def bootstrap_median_ci(
    values: Sequence[float], num_resamples: int = DEFAULT_NUM_RESAMPLES, seed: int = DEFAULT_SEED,
    level: float = 0.95,
) -> tuple[float, float]:
    """The percentile bootstrap interval of the median: `num_resamples` resamples of `values` with
    replacement (drawn from random.Random(seed)), the median of each, and the (1 - level) / 2 and
    (1 + level) / 2 percentiles of those medians."""
    if not values:
        raise ValueError("bootstrap of no values")
    if num_resamples < 1:
        raise ValueError(f"num_resamples is {num_resamples}; it must be at least 1")
    if not 0 < level < 1:
        raise ValueError(f"level is {level}; it must be in (0, 1)")
    rng = random.Random(seed)
    n = len(values)
    medians = [statistics.median(rng.choices(values, k=n)) for _ in range(num_resamples)]
    tail = (1 - level) / 2 * 100
    return percentile(medians, tail), percentile(medians, 100 - tail)


def overhead_summary(
    values: Sequence[float], baseline: Sequence[float], num_resamples: int = DEFAULT_NUM_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> dict[str, Any]:
    """The paired overhead of `values` over `baseline` for a report: per round, its median, and the
    bootstrap 95% interval of that median (with the resample count and seed that reproduce it)."""
    overheads = paired_overheads(values, baseline)
    low, high = bootstrap_median_ci(overheads, num_resamples, seed)
    return {
        "median": statistics.median(overheads),
        "ci95_low": low,
        "ci95_high": high,
        "per_prompt": overheads,
        "num_resamples": num_resamples,
        "seed": seed,
    }
