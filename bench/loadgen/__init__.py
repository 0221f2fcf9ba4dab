"""pdserve bench: a load generator for any OpenAI-compatible server, measuring TTFT, TPOT, ITL,
E2E latency, throughput and goodput under SLOs as vLLM's and SGLang's serving benchmarks define them.

One file a step: `config` (BenchConfig: what to send, how fast, what is good), `workloads` (the
requests), `arrivals` (when each is sent), `client` (one streamed request -> one RequestRecord),
`runner` (the schedule, the concurrency limit, the duration cap, the progress bar), `records` and
`metrics` (pure functions over recorded timings, and the checks), `report` (summary, JSON, PNG),
`cli` (`pdserve bench`, `python -m bench.loadgen`).

This package imports no HTTP library, numpy or matplotlib at import time (`pdserve` builds its
parser from `cli` on every command); `client` needs aiohttp and `report` matplotlib when they run.
"""

from bench.loadgen.arrivals import arrival_offsets
from bench.loadgen.config import BenchConfig
from bench.loadgen.metrics import SLO, LatencyStats, Metrics, MetricsError, check_metrics, compute_metrics, percentile
from bench.loadgen.records import RecordError, RequestRecord, check_record
from bench.loadgen.workloads import (
    BenchRequest,
    WorkloadError,
    build_workload,
    jsonl_workload,
    prefix_workload,
    random_workload,
)

__all__ = [
    "SLO", "BenchConfig", "BenchRequest", "LatencyStats", "Metrics", "MetricsError", "RecordError", "RequestRecord",
    "WorkloadError", "arrival_offsets", "build_workload", "check_metrics", "check_record", "compute_metrics",
    "jsonl_workload", "percentile", "prefix_workload", "random_workload",
]
