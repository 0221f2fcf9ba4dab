"""Results of `pdserve bench`: the environment it ran in, the summary table it prints, the JSON it
writes, and its PNG plots (latency CDFs for one run; goodput, p90 TTFT and TPOT, and p99 ITL
against request rate for a sweep). The JSON is written first; where matplotlib is missing, only it is.

Knows nothing of HTTP or schedules: it formats what the runs measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadgen.config import BenchConfig
from loadgen.metrics import LatencyStats, Metrics
from loadgen.records import RequestRecord


@dataclass(frozen=True)
class RateRun:
    """One run of a sweep (or the only run): its arrival rate, workload seed, records and metrics."""

    request_rate: float
    seed: int
    num_not_sent: int
    is_capped: bool
    metrics: Metrics
    records: list[RequestRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "request_rate": _finite(self.request_rate), "seed": self.seed, "num_not_sent": self.num_not_sent,
            "is_capped": self.is_capped, "metrics": self.metrics.to_json(),
            "records": [r.to_json() for r in self.records],
        }


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf: "inf"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def environment(config: BenchConfig) -> dict[str, Any]:
    """Where the client ran and what it ran against (the server's device is in --label)."""
    return {
        "label": config.label,
        "server": {"base_url": config.base_url, "model": config.model, "endpoint": config.endpoint},
        "client_cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # 1, 5, 15 min, as the results are written
        "python_version": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def workload_line(config: BenchConfig) -> str:
    c = config

    def span(r: tuple[int, int]) -> str:
        return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"

    if c.workload == "jsonl":
        what = f"jsonl {c.dataset}"
    elif c.workload == "prefix":
        what = f"{c.num_prefixes} shared prefixes of {c.prefix_len} + {span(c.input_len)} {c.prompt_format}"
    else:
        what = f"random {span(c.input_len)} {c.prompt_format}"
    arrivals = "Poisson" if c.burstiness == 1 else f"gamma (burstiness {c.burstiness:g})"
    limit = f", max concurrency {c.max_concurrency}" if c.max_concurrency else ""
    return (f"/v1/{'chat/completions' if c.endpoint == 'chat' else 'completions'}: {c.num_prompts} prompts, {what} "
            f"-> {span(c.output_len)} out, {arrivals} arrivals{limit}, seed {c.seed}")


def title(config: BenchConfig, env: dict[str, Any]) -> str:
    slo = [f"TTFT <= {config.slo_ttft_ms:g} ms" if config.slo_ttft_ms else "",
           f"TPOT <= {config.slo_tpot_ms:g} ms" if config.slo_tpot_ms else ""]
    slo_text = " and ".join(s for s in slo if s) or "none"
    what = textwrap.fill(f"pdserve bench: {config.label or config.base_url}", 150)
    return (f"{what}\n"
            f"{workload_line(config)}; SLO {slo_text}\n"
            f"client {env['client_cpu']} ({env['num_cpus']} CPUs, load {env['load_average'][0]}), {env['date']}")


def _stats_row(name: str, s: LatencyStats) -> str:
    def ms(x: float | None) -> str:
        return f"{x:10.2f}" if x is not None else f"{'-':>10}"

    return f"  {name:<6}{ms(s.mean)}{ms(s.median)}{ms(s.p90)}{ms(s.p99)}{s.count:>8}"


def summary(run: RateRun) -> str:
    """vLLM-style summary lines of one run."""
    m = run.metrics
    lines = [
        f"---- request rate {run.request_rate:g}/s ----",
        f"  sent {m.num_sent} = completed {m.num_completed} + errored {m.num_errored}"
        + (f"  (not sent: {run.num_not_sent}, duration cap)" if run.num_not_sent else ""),
        f"  duration {m.duration_s:.2f} s; tokens in {m.total_prompt_tokens}, out {m.total_completion_tokens}"
        + (f" ({m.num_off_length} requests not at max_tokens)" if m.num_off_length else ""),
        f"  throughput {m.request_throughput:.2f} req/s, {m.output_token_throughput:.1f} out tok/s, "
        f"{m.total_token_throughput:.1f} total tok/s"
        + (f"; goodput {m.goodput:.2f} req/s ({m.num_good}/{m.num_completed} within SLO)" if m.goodput is not None
           else ""),
        f"  {'ms':<6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'count':>8}",
        _stats_row("TTFT", m.ttft_ms), _stats_row("TPOT", m.tpot_ms),
        _stats_row("ITL", m.itl_ms), _stats_row("E2E", m.e2e_ms),
    ]
    lines += [f"  error x{n}: {message}" for message, n in list(m.errors.items())[:5]]
    return "\n".join(lines)


def write_results(out: Path, config: BenchConfig, env: dict[str, Any], runs: Sequence[RateRun]) -> tuple[Path, Path]:
    """Writes OUT (JSON: environment, config, every run's metrics and records) and OUT's .png."""
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    doc = {
        "benchmark": "loadgen_sweep" if config.sweep_rates else "loadgen",
        "environment": env,
        "config": json.loads(config.model_dump_json()),
        "runs": [run.to_json() for run in runs],
    }
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: wrote {out} without its plot")
        return out, png
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 7.5))
    (_plot_sweep if len(runs) > 1 else _plot_cdfs)(fig, config, runs)
    fig.suptitle(title(config, env), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return out, png


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    if values_ms:
        xs = sorted(values_ms)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def _plot_cdfs(fig: Any, config: BenchConfig, runs: Sequence[RateRun]) -> None:
    panels = (("TTFT", config.slo_ttft_ms), ("TPOT", config.slo_tpot_ms), ("ITL", None), ("E2E", None))
    for k, (name, slo) in enumerate(panels):
        ax = fig.add_subplot(2, 2, k + 1)
        for run in runs:
            done = [r for r in run.records if r.is_success]
            values = {"TTFT": [r.ttft for r in done], "TPOT": [t for r in done if (t := r.tpot) is not None],
                      "ITL": [g for r in done for g in r.itls], "E2E": [r.e2e for r in done]}[name]
            _cdf(ax, [v * 1e3 for v in values], f"{run.request_rate:g} req/s")
        if slo:
            ax.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _plot_sweep(fig: Any, config: BenchConfig, runs: Sequence[RateRun]) -> None:
    rates = [r.request_rate for r in runs]
    ax = fig.add_subplot(2, 2, 1)
    ax.plot(rates, [r.metrics.request_throughput for r in runs], "o-", label="throughput (completed)")
    if config.has_slo:
        ax.plot(rates, [_nan(r.metrics.goodput) for r in runs], "s-", label="goodput (within SLO)")
    ax.plot(rates, rates, ":", color="gray", label="offered rate")
    ax.set_ylabel("requests/s")
    panels = (("p90 TTFT (ms)", lambda m: m.ttft_ms.p90, config.slo_ttft_ms),
              ("p90 TPOT (ms)", lambda m: m.tpot_ms.p90, config.slo_tpot_ms),
              ("p99 ITL (ms)", lambda m: m.itl_ms.p99, None))
    axes = [ax]
    for k, (name, value, slo) in enumerate(panels):
        ax = fig.add_subplot(2, 2, k + 2)
        ax.plot(rates, [_nan(value(r.metrics)) for r in runs], "o-")
        if slo:
            ax.axhline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
            ax.legend(fontsize=8)
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        axes.append(ax)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
