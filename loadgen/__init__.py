"""The load generator behind `pdserve bench`: an HTTP client of the OpenAI API (streamed
/v1/completions or /v1/chat/completions) that sends a workload at a request rate and measures TTFT,
TPOT, ITL, E2E latency, throughput and goodput under SLOs as vLLM's and SGLang's serving benchmarks
define them.

It knows only the OpenAI API: nothing of pdserve's router, workers, KV transfer, engine or Ray, so
it measures any OpenAI-compatible server (pdserve, vLLM, SGLang) alike. The benchmarks in bench/
may import it; it imports nothing of bench/ or of the rest of pdserve.

One file a step: `config` (BenchConfig: what to send, how fast, what is good), `workloads` (the
requests), `arrivals` (when each is sent), `client` (one streamed request -> one RequestRecord),
`runner` (the schedule, the concurrency limit, the duration cap, the progress bar), `records` and
`metrics` (pure functions over recorded timings, and the checks), `report` (summary, JSON, PNG),
`cli` (`pdserve bench`, `python -m loadgen`).

Public names (`__all__`): BenchConfig; BenchRequest, WorkloadError, build_workload,
random_workload, prefix_workload, jsonl_workload; arrival_offsets; RequestRecord, RecordError,
check_record; SLO, LatencyStats, Metrics, MetricsError, compute_metrics, check_metrics, percentile.
The client (`client.OpenAIStreamClient`), the runner (`runner.run_requests`), the report
(`report.RateRun`, `report.summary`) and the command (`cli.main`, `cli.bench`, `cli.run_rate`) are
reached through their modules.

This package imports no HTTP library, numpy or matplotlib at import time (`pdserve` builds its
parser from `cli` on every command); `client` needs aiohttp and `report` matplotlib when they run.
"""

from loadgen.arrivals import arrival_offsets
from loadgen.config import BenchConfig
from loadgen.metrics import SLO, LatencyStats, Metrics, MetricsError, check_metrics, compute_metrics, percentile
from loadgen.records import RecordError, RequestRecord, check_record
from loadgen.workloads import (
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
