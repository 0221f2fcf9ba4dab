"""A rate step (issue 24: 4 -> 16 -> 4 req/s over three minutes on two GPUs): one continuous run whose
Poisson arrival rate changes at set times, scored against the SLOs by when each request was sent.

`bench.goodput --schedule 4:60,16:60,4:60` runs it instead of a sweep, for each mode: this module holds
the schedule, its arrival times, the score, and the run itself (`step_run`, with each worker's role
over it from bench/worker_timeline.py's samples). Per window of `window_s` seconds (by send
time): the share of requests that met both SLOs. After each change of rate a transition lasts until
the first window from which every window of that segment holds >= 90% (whole windows: a transition is
a multiple of window_s); the run passes when every transition lasts at most `max_transition_s` and the
requests sent outside transitions meet the SLOs >= 90%, with none lost (every request completed).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bench.worker_timeline import role_changes
from loadgen.arrivals import arrival_offsets

if TYPE_CHECKING:
    from bench.goodput import Plan
    from bench.goodput_report import ModeResult
    from bench.server_process import ServerProcess

ATTAINMENT = 0.9


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """'4:60,16:60,4:60' -> ((4, 60), (16, 60), (4, 60)): (req/s, seconds) segments in order."""
    out = []
    for part in text.split(","):
        try:
            rate, seconds = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--schedule: expected RATE:SECONDS segments like 4:60,16:60, got {part!r}") from None
        if rate <= 0 or seconds <= 0:
            raise ValueError(f"--schedule: rate and seconds must be > 0, got {part!r}")
        out.append((rate, seconds))
    if not out:
        raise ValueError("--schedule: no segment given")
    return tuple(out)


def arrivals(schedule: Sequence[tuple[float, float]], seed: int) -> list[float]:
    """Every request's arrival time: a Poisson process within each segment at its rate (a seed per
    segment), the arrivals that fall inside it; so the count varies around rate x seconds as it would."""
    out: list[float] = []
    start = 0.0
    for k, (rate, seconds) in enumerate(schedule):
        gaps = arrival_offsets(math.ceil(2 * rate * seconds) + 10, rate, seed=seed + k)  # more than will fit
        out += [start + t for t in gaps if t < seconds]
        start += seconds
    return out


def score(records: Sequence[dict[str, Any]], schedule: Sequence[tuple[float, float]], ttft_ms: float, tpot_ms: float,
          num_planned: int, window_s: float = 10.0, max_transition_s: float = 30.0) -> dict[str, Any]:
    """records: per request {send_s, ok, ttft_ms, tpot_ms} (bench.goodput's compact records)."""

    def good(r: dict[str, Any]) -> bool:
        return bool(r["ok"]) and r["ttft_ms"] <= ttft_ms and (r["tpot_ms"] is None or r["tpot_ms"] <= tpot_ms)

    total_s = sum(s for _, s in schedule)
    num_windows = math.ceil(total_s / window_s)
    sent = [[] for _ in range(num_windows)]  # type: list[list[bool]]
    for r in records:
        k = min(int(r["send_s"] // window_s), num_windows - 1)
        sent[k].append(good(r))
    windows = [{"start_s": k * window_s, "num_requests": len(w), "attainment": sum(w) / len(w) if w else None}
               for k, w in enumerate(sent)]
    transitions = []
    in_transition = [False] * num_windows
    start = 0.0
    for k, (rate, seconds) in enumerate(schedule):
        first, last = int(start // window_s), math.ceil((start + seconds) / window_s)
        if k:  # NOTE: the first segment starts the run: no change of rate before it
            ok_from = last
            for j in range(last - 1, first - 1, -1):  # the earliest window from which all later ones hold
                a = windows[j]["attainment"]
                if a is not None and a < ATTAINMENT:
                    break
                ok_from = j
            length = (ok_from - first) * window_s
            transitions.append({"at_s": start, "to_rate": rate, "seconds": length,
                                "is_within_limit": length <= max_transition_s})
            for j in range(first, ok_from):
                in_transition[j] = True
        start += seconds
    outside = [g for k, w in enumerate(sent) if not in_transition[k] for g in w]
    attainment = sum(outside) / len(outside) if outside else 0.0
    num_lost = num_planned - sum(1 for r in records if r["ok"])
    return {
        "window_s": window_s, "windows": windows, "transitions": transitions,
        "attainment_outside_transitions": attainment, "num_lost": num_lost,
        "is_met": attainment >= ATTAINMENT and all(t["is_within_limit"] for t in transitions) and num_lost == 0,
    }


# ---- the run (bench.goodput's, for a mode whose server is up)
async def step_run(plan: Plan, result: ModeResult, server: ServerProcess, base_url: str, deadline: float,
                   echo: Callable[[str], None], note: Callable[[str], None],
                   checkpoint: Callable[[ModeResult], None]) -> None:
    """The rate step of plan.schedule as one run, into RESULT.runs (one RateRun at the mean rate) and
    RESULT.step (bench.rate_step.score, and the roles' changes in RESULT.timeline, which bench.goodput fills
    while the run lasts)."""
    from bench.goodput import STOP_RESERVE_S
    from loadgen.cli import client_for
    from loadgen.metrics import SLO, compute_metrics
    from loadgen.report import RateRun, summary
    from loadgen.runner import run_requests
    from loadgen.workloads import build_workload

    total_s = sum(seconds for _, seconds in plan.schedule)
    window = total_s + plan.drain_s
    if time.monotonic() + window + STOP_RESERVE_S > deadline:
        result.skipped["schedule"] = "out of time"
        return
    result.phase = "schedule"
    offsets = arrivals(plan.schedule, plan.seed)
    config = plan.bench_config(base_url, 1.0).model_copy(
        update={"num_prompts": len(offsets), "duration": window, "request_timeout": window + 10})
    requests = build_workload(config, plan.seed)
    started = time.perf_counter()
    async with client_for(config) as client:
        ran = await asyncio.wait_for(run_requests(requests, offsets, client.send, duration=window,
                                                  max_concurrency=config.max_concurrency), window + 30)
    result.phases_s[result.phase] = round(time.perf_counter() - started, 1)
    metrics = compute_metrics(ran.records, ran.duration_s, SLO(plan.slo_ttft_ms, plan.slo_tpot_ms))
    result.runs.append(RateRun(len(offsets) / total_s, plan.seed, ran.num_not_sent, ran.is_capped, metrics,
                               ran.records))
    records = [{"send_s": r.send_time, "ok": r.is_success, "ttft_ms": r.ttft * 1e3 if r.is_success else None,
                "tpot_ms": r.tpot * 1e3 if r.is_success and r.tpot is not None else None} for r in ran.records]
    result.step = {"schedule": [list(x) for x in plan.schedule], "roles": role_changes(result.timeline),
                   **score(records, plan.schedule, plan.slo_ttft_ms, plan.slo_tpot_ms, ran.num_planned)}
    checkpoint(result)
    note(summary(result.runs[-1]))
    step = result.step
    echo(f"{result.mode} schedule {plan.schedule}: {100 * step['attainment_outside_transitions']:.0f}% within SLO "
         f"outside transitions of {[t['seconds'] for t in step['transitions']]} s, {step['num_lost']} lost, "
         f"{'met' if step['is_met'] else 'NOT met'}")
    server.check_alive()
