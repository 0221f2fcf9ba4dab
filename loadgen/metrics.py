"""compute_metrics(records, duration_s, slo): the serving metrics as vLLM's and SGLang's serving
benchmarks define them, a pure function over recorded per-request timings; and check_metrics, which
re-derives them from the records and raises on any disagreement.

Definitions (over completed requests; times per request from its record):
  TTFT  first token chunk - send                      E2E   end of stream - send
  TPOT  (E2E - TTFT) / (completion_tokens - 1), for requests of more than one token
  ITL   every gap between consecutive token chunks, pooled over all requests
  throughputs: completed requests, completion tokens, prompt + completion tokens, each / duration
  goodput: completed requests with TTFT <= SLO and TPOT <= SLO (TPOT counted 0 for one-token
           requests, as vLLM does), / duration
Percentiles interpolate linearly between order statistics (numpy's default, which vLLM uses).

Knows nothing of HTTP, clocks or files.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadgen.config import PERCENTILES
from loadgen.records import RecordError, RequestRecord, check_record


class MetricsError(ValueError):
    """Metrics that disagree with the records they came from (counts, throughputs, duration)."""


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def is_met(self, record: RequestRecord) -> bool:
        tpot_ms = (record.tpot or 0.0) * 1e3  # one-token requests have TPOT 0 here (vLLM)
        return ((self.ttft_ms is None or record.ttft * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_ms <= self.tpot_ms))


@dataclass(frozen=True)
class LatencyStats:
    """One latency's summary, in ms; None where there were no values."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class Metrics:
    num_sent: int  # requests that left the client: num_completed + num_errored
    num_completed: int
    num_errored: int
    num_good: int | None  # completed within the SLOs; None without SLOs
    num_off_length: int  # completed whose completion_tokens differ from the max_tokens asked
    duration_s: float
    total_prompt_tokens: int  # from usage, completed requests
    total_completion_tokens: int  # from usage, completed requests
    request_throughput: float  # completed requests / s
    goodput: float | None  # good requests / s; None without SLOs
    output_token_throughput: float  # completion tokens / s
    total_token_throughput: float  # (prompt + completion tokens) / s
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    slo: SLO = field(default_factory=SLO)
    errors: dict[str, int] = field(default_factory=dict)  # "status: message" -> count

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    """Mean, median, p90, p99 and max of latencies given in s, reported in ms."""
    if not values_s:
        return LatencyStats(0, None, None, None, None, None)
    ms = [v * 1e3 for v in values_s]
    p50, p90, p99 = (percentile(ms, p) for p in PERCENTILES)
    return LatencyStats(len(ms), sum(ms) / len(ms), p50, p90, p99, max(ms))


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> Metrics:
    """The run's metrics from its records; every record is checked first (RecordError on a bad one)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slo = slo or SLO()
    for r in records:
        check_record(r)
    done = [r for r in records if r.is_success]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    completion_tokens = sum(r.completion_tokens for r in done)
    num_good = sum(slo.is_met(r) for r in done) if slo.is_set else None
    errors = Counter(f"{r.http_status if r.http_status is not None else 'no HTTP status'}: {r.error}"
                     for r in records if not r.is_success)
    return Metrics(
        num_sent=len(records),
        num_completed=len(done),
        num_errored=len(records) - len(done),
        num_good=num_good,
        num_off_length=sum(r.completion_tokens != r.max_tokens for r in done),
        duration_s=duration_s,
        total_prompt_tokens=prompt_tokens,
        total_completion_tokens=completion_tokens,
        request_throughput=len(done) / duration_s,
        goodput=num_good / duration_s if num_good is not None else None,
        output_token_throughput=completion_tokens / duration_s,
        total_token_throughput=(prompt_tokens + completion_tokens) / duration_s,
        ttft_ms=latency_stats([r.ttft for r in done]),
        tpot_ms=latency_stats([t for r in done if (t := r.tpot) is not None]),
        itl_ms=latency_stats([gap for r in done for gap in r.itls]),
        e2e_ms=latency_stats([r.e2e for r in done]),
        slo=slo,
        errors=dict(errors.most_common()),
    )


def check_metrics(metrics: Metrics, records: Sequence[RequestRecord]) -> None:
    """Raises MetricsError unless the metrics follow from the records: counts reconcile (sent =
    completed + errored = records), every record passes check_record (TTFT <= E2E), the run lasted
    at least as long as its requests, and each throughput is its count / duration."""
    m = metrics
    try:
        for r in records:
            check_record(r)
    except RecordError as err:
        raise MetricsError(str(err)) from None
    done = [r for r in records if r.is_success]
    if not m.num_sent == m.num_completed + m.num_errored == len(records) or m.num_completed != len(done):
        raise MetricsError(f"counts do not reconcile: sent {m.num_sent} != completed {m.num_completed} + errored "
                           f"{m.num_errored}, or != {len(records)} records ({len(done)} successes)")
    if records:
        span = max(r.end_time for r in records) - min(r.send_time for r in records)
        if m.duration_s < span * (1 - 1e-9):
            raise MetricsError(f"duration {m.duration_s:.6f} s is shorter than the requests' span {span:.6f} s")
    tokens = (sum(r.prompt_tokens for r in done), sum(r.completion_tokens for r in done))
    if (m.total_prompt_tokens, m.total_completion_tokens) != tokens:
        raise MetricsError(f"token totals {m.total_prompt_tokens}, {m.total_completion_tokens} != records' {tokens}")
    expected = {
        "request_throughput": len(done) / m.duration_s,
        "output_token_throughput": tokens[1] / m.duration_s,
        "total_token_throughput": sum(tokens) / m.duration_s,
    }
    for name, value in expected.items():
        if not math.isclose(getattr(m, name), value, rel_tol=1e-9, abs_tol=1e-12):
            raise MetricsError(f"{name} {getattr(m, name)} != count / duration = {value}")
