"""The results of bench/goodput.py: one row per request rate, each mode's summary (best goodput, the
highest rate that met the SLOs for 90 % of its requests), the disaggregated / colocated comparison
against the 2x goal, the final table, and the plot.

Pure functions over loadgen's RateRuns and the driver's ModeResults: no servers, no clocks.

Definitions (per rate; vLLM's goodput):
  goodput         requests that met both SLOs (TTFT and TPOT, each request on its own) / run duration;
                  the duration runs from the first arrival to the last request's end (drain included)
  slo_attainment  requests that met both SLOs / requests planned at that rate (sent or not)
  ratio           best goodput of disagg over the sweep / best goodput of colocated over the sweep
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.report import RateRun

GOAL_RATIO = 2.0
"""The goal of project issue 9: disaggregated goodput at least twice the colocated one."""

ATTAINMENT_FOR_MAX_RATE = 0.9
"""A rate 'holds' the SLOs when this fraction of its requests met them (DistServe's definition)."""


@dataclass
class ModeResult:
    """What one serving mode produced: its rates' runs, or where and why it failed (runs kept so far)."""

    mode: str
    description: str
    serve_argv: list[str]
    status: str = "not run"  # "ok" | "failed" | "not run"
    phase: str = "not started"  # the phase running now, or the one that failed
    error: str | None = None
    phases_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds it took
    runs: list[RateRun] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # rate -> why it was not run
    stopped: str = ""  # how the server ended
    log_tail: list[str] = field(default_factory=list)  # the server log's last lines, when it failed
    step: dict[str, Any] | None = None  # a rate step's score and the workers' roles over it (bench/rate_step.py)
    pushes: dict[str, Any] | None = None  # the KV pushes of the rates run, from /metrics (bench.goodput.push_totals)
    # each worker's role, running and waiting requests and KV use, every second while the rates ran
    # (bench/worker_timeline.py; t_s from the first rate's start)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # an autoscaled server's `pdserve status` after the rates: every pool's workers (draining ones too,
    # which the routers' /metrics no longer show) and the autoscaler's last decisions
    cluster_status: list[str] = field(default_factory=list)
    # its autoscaler's readings, one a round (cluster/autoscaler.py: PressureSample; t_s from the first rate's start)
    autoscaler_trace: list[dict[str, Any]] = field(default_factory=list)

    def fail(self, err: BaseException | str) -> None:
        self.status = "failed"
        if isinstance(err, str):
            self.error = err
        else:  # NOTE: asyncio's TimeoutError says nothing by itself
            self.error = f"{type(err).__name__}: {str(err) or 'the phase ran past its time limit'}"


def rate_row(run: RateRun) -> dict[str, Any]:
    """One rate's figures: goodput, SLO attainment, latency percentiles (ms), counts."""
    m = run.metrics
    num_planned = m.num_sent + run.num_not_sent
    num_good = m.num_good or 0
    return {
        "rate": run.request_rate,
        "goodput": m.goodput or 0.0,
        "slo_attainment": num_good / num_planned if num_planned else 0.0,
        "throughput": m.request_throughput,
        "output_tok_s": m.output_token_throughput,
        "num_planned": num_planned,
        "num_completed": m.num_completed,
        "num_good": num_good,
        "num_errored": m.num_errored,
        "num_not_sent": run.num_not_sent,
        "duration_s": m.duration_s,
        "ttft_p50_ms": m.ttft_ms.median,
        "ttft_p90_ms": m.ttft_ms.p90,
        "tpot_p50_ms": m.tpot_ms.median,
        "tpot_p90_ms": m.tpot_ms.p90,
        "itl_p50_ms": m.itl_ms.median,
        "itl_p99_ms": m.itl_ms.p99,
        "e2e_p90_ms": m.e2e_ms.p90,
        "errors": dict(list(m.errors.items())[:5]),
    }


def best_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The row of highest goodput (the lower rate on a tie); None without rows."""
    if not rows:
        return None
    return max(rows, key=lambda r: (r["goodput"], -r["rate"]))


def max_rate_within_slo(rows: Sequence[Mapping[str, Any]], attainment: float = ATTAINMENT_FOR_MAX_RATE) -> float | None:
    """The highest rate whose SLO attainment reached ATTAINMENT, and every lower rate's too; None if the
    lowest did not."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if row["slo_attainment"] < attainment:
            break
        best = row["rate"]
    return best


def mode_summary(result: ModeResult) -> dict[str, Any]:
    rows = [rate_row(run) for run in result.runs]
    best = best_row(rows)
    return {
        "mode": result.mode, "description": result.description, "status": result.status, "phase": result.phase,
        "error": result.error, "serve_argv": result.serve_argv, "phases_s": result.phases_s,
        "stopped": result.stopped, "skipped_rates": result.skipped, "rows": rows,
        "best": dict(best) if best is not None else None,
        "max_rate_at_90pct_slo": max_rate_within_slo(rows),
        "log_tail": result.log_tail,
        **({"step": result.step} if result.step is not None else {}),
        **({"pushes": result.pushes} if result.pushes is not None else {}),
        "timeline": result.timeline,
        **({"autoscaler_trace": result.autoscaler_trace} if result.autoscaler_trace else {}),
    }


def compare(summaries: Mapping[str, Mapping[str, Any]], goal: float = GOAL_RATIO) -> dict[str, Any]:
    """disagg / colocated best goodput, and whether it reaches GOAL; with a reason where it cannot be
    computed (a mode failed before any rate, or colocated served nothing within the SLOs)."""
    out: dict[str, Any] = {"goal_ratio": goal, "ratio": None, "is_goal_met": None, "is_partial": False,
                           "reason": "", "per_rate": []}
    for name in ("disagg", "colocated"):
        s = summaries.get(name)
        if s is None:
            return {**out, "reason": f"{name} was not run"}
        if s["best"] is None:
            why = f"{s['status']} in phase {s['phase']!r}: {s['error']}" if s["status"] == "failed" else s["status"]
            return {**out, "reason": f"{name} has no measured rate ({why})"}
    disagg, colocated = summaries["disagg"], summaries["colocated"]
    by_rate = {r["rate"]: r for r in colocated["rows"]}
    out["per_rate"] = [
        {"rate": r["rate"], "disagg": r["goodput"], "colocated": by_rate[r["rate"]]["goodput"],
         "ratio": _ratio(r["goodput"], by_rate[r["rate"]]["goodput"])}
        for r in disagg["rows"] if r["rate"] in by_rate
    ]
    out["is_partial"] = disagg["status"] != "ok" or colocated["status"] != "ok"
    out["disagg_best"] = {"rate": disagg["best"]["rate"], "goodput": disagg["best"]["goodput"]}
    out["colocated_best"] = {"rate": colocated["best"]["rate"], "goodput": colocated["best"]["goodput"]}
    ratio = _ratio(disagg["best"]["goodput"], colocated["best"]["goodput"])
    if ratio is None:
        return {**out, "reason": "colocated met the SLOs for no request at any rate: no ratio"}
    return {**out, "ratio": ratio, "is_goal_met": ratio >= goal}


def scaleout(summaries: Mapping[str, Mapping[str, Any]], layout: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """For the scale-out runs: each disaggregated mode's best goodput over that of the colocated mode
    with as many workers (GPUs), and the scaling efficiency from 1P1D to 2P2D (best 2P2D / 2 x best 1P1D).
    LAYOUT: mode -> (prefill workers, decode workers), prefill 0 for colocated (decode = replicas)."""
    best = {n: (s["best"] or {}).get("goodput") for n, s in summaries.items()}
    colocated = {p + d: n for n, (p, d) in layout.items() if p == 0 and n in summaries}
    pairs = []
    for name, (p, d) in layout.items():
        if p == 0 or name not in summaries:
            continue
        other = colocated.get(p + d)
        ratio = (_ratio(best[name], best[other])
                 if other and best[name] is not None and best[other] is not None else None)
        pairs.append({"mode": name, "num_gpus": p + d, "colocated": other, "goodput": best[name],
                      "colocated_goodput": best.get(other) if other else None, "ratio": ratio})
    by_shape = {layout[n]: n for n in summaries if n in layout}
    one, two = by_shape.get((1, 1)), by_shape.get((2, 2))
    efficiency = None
    if one and two and best[one] and best[two] is not None:
        efficiency = best[two] / (2 * best[one])
    return {"pairs": pairs, "scaling_1p1d_to_2p2d": efficiency, "scaling_goal": 0.9}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def table(summaries: Mapping[str, Mapping[str, Any]], comparison: Mapping[str, Any]) -> str:
    """The final table: one line per mode and rate, then each mode's best and the ratio."""
    head = (f"{'mode':<10}{'rate':>6}{'goodput':>9}{'attain':>8}{'TTFT p90':>10}{'TPOT p90':>10}{'ITL p99':>9}"
            f"{'done/plan':>11}{'errors':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        for r in s["rows"]:
            lines.append(f"{name:<10}{r['rate']:>6g}{r['goodput']:>9.2f}{r['slo_attainment']:>8.0%}"
                         f"{_ms(r['ttft_p90_ms']):>10}{_ms(r['tpot_p90_ms']):>10}{_ms(r['itl_p99_ms']):>9}"
                         f"{r['num_completed']:>6}/{r['num_planned']:<4}{r['num_errored']:>8}")
        for rate, why in s["skipped_rates"].items():
            lines.append(f"{name:<10}{rate:>6}  skipped: {why}")
        if s["status"] != "ok":
            lines.append(f"{name:<10} FAILED in phase {s['phase']!r}: {s['error']}")
    for name, s in summaries.items():
        best = s["best"]
        if best is not None:
            lines.append(f"best goodput {name}: {best['goodput']:.2f} req/s at {best['rate']:g} req/s; "
                         f"SLOs held (>= 90 %) up to {s['max_rate_at_90pct_slo']} req/s")
    c = comparison
    if c["ratio"] is not None:
        verdict = "met" if c["is_goal_met"] else "not met"
        lines.append(f"disagg / colocated best goodput = {c['ratio']:.2f} (goal {c['goal_ratio']:g}x: {verdict})"
                     + (" [partial: a mode failed]" if c["is_partial"] else ""))
    else:
        lines.append(f"no ratio: {c['reason']}")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def plot(fig: Any, summaries: Mapping[str, Mapping[str, Any]], comparison: Mapping[str, Any],
         slo_ttft_ms: float, slo_tpot_ms: float) -> None:
    """Goodput (with 2x colocated, the goal), p90 TTFT, p90 TPOT and p99 ITL against the request rate."""
    panels = [("goodput (req/s within both SLOs)", "goodput", None), ("p90 TTFT (ms)", "ttft_p90_ms", slo_ttft_ms),
              ("p90 TPOT (ms)", "tpot_p90_ms", slo_tpot_ms), ("p99 inter-token latency (ms)", "itl_p99_ms", None)]
    styles = {"disagg": ("tab:blue", "o-"), "colocated": ("tab:orange", "s-")}
    for k, (label, key, slo) in enumerate(panels):
        ax = fig.add_subplot(2, 2, k + 1)
        for name, s in summaries.items():
            color, marker = styles.get(name, ("tab:gray", "^-"))
            rows = s["rows"]
            status = "" if s["status"] == "ok" else f" (FAILED: {s['phase']})"
            ax.plot([r["rate"] for r in rows], [_nan(r[key]) for r in rows], marker, color=color,
                    label=f"{s['description']}{status}")
            if key == "goodput" and name == "colocated" and rows:
                ax.plot([r["rate"] for r in rows], [comparison["goal_ratio"] * r["goodput"] for r in rows], "--",
                        color=color, alpha=0.6, label=f"goal: {comparison['goal_ratio']:g}x colocated")
        if key == "goodput":
            rates = sorted({r["rate"] for s in summaries.values() for r in s["rows"]})
            if rates:
                ax.plot(rates, rates, ":", color="gray", label="offered rate")
            ratio = comparison["ratio"]
            ax.set_title(f"best-goodput ratio disagg/colocated: {ratio:.2f}" if ratio is not None
                         else f"no ratio: {comparison['reason']}"[:90], fontsize=9)
        if slo:
            ax.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
