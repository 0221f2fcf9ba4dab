"""The planner: for a profile, a workload and SLOs on N GPUs, each layout's goodput (the highest
request rate at which at least 90% of requests meet both SLOs), found by a sweep over simulated
runs, and the best layout with why.

The sweep doubles the rate from `start_rate` until attainment falls under the target, then bisects
between the last rate that met it and the first that did not. Every rate draws the same request
lengths and the same arrival pattern, scaled (one seed), so attainment falls with the rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.planner.profile import StepProfile
from cluster.planner.simulate import Layout, Profiles, Timing, by_size, simulate
from cluster.planner.workload import SLO, Workload, requests

ATTAINMENT = 0.9
"""Share of requests that must meet both SLOs at a rate that counts toward goodput."""


@dataclass(frozen=True)
class RatePoint:
    rate: float  # requests per second
    attainment: float  # share meeting both SLOs
    missed_ttft: float  # share missing the TTFT SLO
    missed_tpot: float  # share missing the TPOT SLO


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    goodput: float  # requests per second; 0: not even start_rate meets the SLOs
    points: list[RatePoint] = field(default_factory=list)  # every rate simulated, ascending

    @property
    def why(self) -> str:
        """What limits it: the SLO most missed at the first rate past its goodput."""
        past = [p for p in self.points if p.attainment < ATTAINMENT]
        if not past:
            return "met the SLOs at every rate tried"
        p = past[0]
        slo = "TTFT" if p.missed_ttft >= p.missed_tpot else "TPOT"
        return (f"at {p.rate:.3g} req/s {100 * p.attainment:.1f}% met both SLOs; {slo} limits it "
                f"({100 * p.missed_ttft:.0f}% missed TTFT, {100 * p.missed_tpot:.0f}% missed TPOT)")


def layouts(num_gpus: int, worker_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    """Colocated replicas, and every xPyD, that use all N GPUs with workers of the given sizes
    (tensor-parallel GPUs per worker; prefill and decode workers may differ)."""
    out = [Layout(0, num_gpus // t, 1, t) for t in worker_sizes if num_gpus % t == 0]
    for a in worker_sizes:
        for b in worker_sizes:
            for x in range(1, num_gpus // a + 1):
                rest = num_gpus - x * a
                if rest > 0 and rest % b == 0:
                    out.append(Layout(x, rest // b, a, b))
    return out


def rate_point(layout: Layout, profile: StepProfile | Profiles, workload: Workload, slo: SLO,
               rate: float) -> RatePoint:
    timings: list[Timing] = simulate(layout, profile, requests(workload, rate))
    n = len(timings)
    ttft_ok = [t.ttft_s * 1e3 <= slo.ttft_ms for t in timings]
    tpot_ok = [t.tpot_s * 1e3 <= slo.tpot_ms for t in timings]
    both = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
    return RatePoint(rate, both / n, 1 - sum(ttft_ok) / n, 1 - sum(tpot_ok) / n)


def goodput(layout: Layout, profile: StepProfile | Profiles, workload: Workload, slo: SLO, start_rate: float = 0.25,
            max_rate: float = 1e4, bisections: int = 7) -> LayoutPlan:
    points = [rate_point(layout, profile, workload, slo, start_rate)]
    if points[0].attainment < ATTAINMENT:
        return LayoutPlan(layout, 0.0, points)
    low, high = start_rate, None
    while high is None and low < max_rate:
        point = rate_point(layout, profile, workload, slo, 2 * low)
        points.append(point)
        if point.attainment >= ATTAINMENT:
            low = 2 * low
        else:
            high = 2 * low
    for _ in range(bisections if high is not None else 0):
        assert high is not None
        mid = (low + high) / 2
        point = rate_point(layout, profile, workload, slo, mid)
        points.append(point)
        low, high = (mid, high) if point.attainment >= ATTAINMENT else (low, mid)
    return LayoutPlan(layout, low, sorted(points, key=lambda p: p.rate))


def plan(num_gpus: int, profile: StepProfile | Profiles, workload: Workload, slo: SLO) -> list[LayoutPlan]:
    """Every layout on num_gpus GPUs with workers of the sizes profiled, best goodput first (ties:
    colocated, then fewer prefill workers, then smaller workers)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus is {num_gpus}; plan for at least 1 GPU")
    sizes = by_size(profile)
    plans = [goodput(layout, sizes, workload, slo) for layout in layouts(num_gpus, tuple(sorted(sizes)))]
    return sorted(plans, key=lambda p: (-p.goodput, p.layout.num_prefill, p.layout.decode_tp, p.layout.prefill_tp))
