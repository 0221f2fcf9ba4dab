"""Prometheus metrics of a router replica, named after vLLM's where one exists (prefix `pdserve:`).

End to end, per finished choice: time to first token, time per output token, inter-token latency,
end-to-end latency (histograms); requests by outcome; tokens. Per worker, refreshed at each
scrape from the workers' `stats()`: running and waiting requests, KV blocks in use, preemptions,
leases. KV pushes: bytes from each prefill answer (what its push sends), and per prefill worker,
from its stats, the pushes done and failed and their seconds (a push ends after its answer).
Each replica counts what it served in its own registry; where the node's replicas share the HTTP port
(`shared_dir`, router/metrics_share.py) a scrape answers with every replica's counts summed. The worker
gauges come from the workers, the same whichever replica answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.api import WorkerStatsMsg
from protocol.messages import PrefillResultMsg
from router.metrics_share import SharedCounts

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.75, 1.0, 2.5)


# Worker gauges set from one field of each worker's stats row: (WorkerStatsMsg field, metric, help).
ROW_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_running", "pdserve:num_requests_running", "Requests in a worker's running batch."),
    ("num_waiting", "pdserve:num_requests_waiting", "Requests waiting in a worker."),
    ("num_preemptions", "pdserve:num_preemptions", "Preemptions since the worker started."),
    ("num_spec_gate_overturns", "pdserve:spec_decode_gate_overturns",
     "Times a worker's draft gate changed whether a batch size drafts, by its measured rates, since start."),
    ("num_requests", "pdserve:worker_requests_joined",
     "Requests that joined a decode worker's batch since it started (how evenly the routers spread them)."),
    # what the 'slo' prefill rule, the step budget and the autoscaler read of each engine's speed
    ("decode_step_s", "pdserve:decode_step_seconds",
     "A worker's measured time of a step that only decodes (0: not measured yet)."),
    ("prefill_tokens_per_s", "pdserve:prefill_tokens_per_second",
     "A worker's measured prompt tokens a second in steps that prefill (0: not measured yet)."),
    ("num_queued_prompt_tokens", "pdserve:num_queued_prompt_tokens",
     "Prompt tokens queued at a worker, not yet computed."),
    # where a worker's engine thread spends its time, and what stalls it (engine/loop.py, engine/parallel/rank_stats.py)
    ("num_engine_steps", "pdserve:engine_steps", "Steps a worker's engine took, since start."),
    ("engine_step_seconds", "pdserve:engine_step_seconds",
     "Wall seconds a worker's engine thread spent inside steps, since start."),
    ("engine_command_seconds", "pdserve:engine_command_seconds",
     "Wall seconds a worker's engine thread spent on commands between steps (requests joining, stats), since start."),
    ("longest_recent_step_seconds", "pdserve:engine_longest_recent_step_seconds",
     "The longest wall time of a worker's last 512 engine steps (a stall inside a step shows here)."),
    ("num_alloc_retries", "pdserve:cuda_alloc_retries",
     "A worker's failed cudaMalloc calls retried after freeing the allocator's cache, every rank's, since start."),
    ("num_device_frees", "pdserve:cuda_device_frees",
     "A worker's cudaFree calls (each synchronizes the device), every rank's, since start."),
    ("step_device_seconds", "pdserve:engine_step_device_seconds",
     "The device time of a worker's steps (rank 0's stream), since start."),
    ("step_wait_seconds", "pdserve:engine_step_wait_seconds",
     "Wall seconds a worker's engine thread waited for its steps' tokens, since start."),
    ("grammar_work_seconds", "pdserve:grammar_work_seconds",
     "Seconds a worker's grammar process spent advancing matchers and filling masks (beside the engine), since start."),
    ("follower_forward_seconds", "pdserve:rank_forward_seconds",
     "Wall seconds a tensor-parallel worker's other ranks spent launching forwards (the most of any), since start."),
    ("follower_call_seconds", "pdserve:rank_call_seconds",
     "Wall seconds a tensor-parallel worker's other ranks spent moving KV (RankCalls; the most of any), since start."),
    ("follower_longest_call_seconds", "pdserve:rank_longest_recent_call_seconds",
     "The longest RankCall of a tensor-parallel worker's other ranks in the last 10 s."),
    ("gc_seconds", "pdserve:gc_pause_seconds",
     "Seconds a worker process's garbage collector paused (holding the GIL) while its engine ran, since start."),
    ("longest_recent_gc_seconds", "pdserve:gc_longest_recent_pause_seconds",
     "A worker process's longest collector pause in the last 10 s."),
    ("follower_gc_seconds", "pdserve:rank_gc_pause_seconds",
     "Seconds the collector paused in a tensor-parallel worker's other ranks (the most of any), since start."),
    ("follower_longest_gc_seconds", "pdserve:rank_gc_longest_recent_pause_seconds",
     "The longest collector pause of a tensor-parallel worker's other ranks in the last 10 s."),
)


class PrometheusMetrics:
    """Implements router.core.RouterMetrics, plus the KV-push and worker gauges."""

    def __init__(self, model_name: str, worker_stats: Callable[[], Awaitable[list[WorkerStatsMsg]]] | None = None,
                 shared_dir: Path | None = None, replica: str = "router"):
        self.registry = CollectorRegistry()  # this replica's counts
        self.worker_registry = CollectorRegistry()  # the workers' stats, set at each scrape
        self.worker_stats = worker_stats
        self.shared = (SharedCounts(shared_dir, replica, lambda: generate_latest(self.registry))
                       if shared_dir is not None else None)
        r, labels = self.registry, {"model_name": model_name}
        self._labels = labels

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        self.ttft = hist("pdserve:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = hist("pdserve:time_per_output_token_seconds", "Mean time per output token after the first.",
                         _TOKEN_BUCKETS)
        self.itl = hist("pdserve:inter_token_latency_seconds", "Time between consecutive output tokens.",
                        _TOKEN_BUCKETS)
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "End-to-end latency of a choice.", _LATENCY_BUCKETS)
        self.success = Counter("pdserve:request_success", "Finished choices by finish reason.",
                               [*labels, "finished_reason"], registry=r)
        self.rejected = Counter("pdserve:requests_rejected", "Requests refused (429 queue full, 503 no capacity).",
                                [*labels, "status_code"], registry=r)
        self.responses = Counter("pdserve:http_responses", "HTTP responses by route and status.",
                                 [*labels, "route", "status_code"], registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens.", list(labels),
                                     registry=r).labels(**labels)
        self.cached_tokens = Counter("pdserve:prefix_cache_hit_tokens", "Prompt tokens served from prefix caches.",
                                     list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens.", list(labels),
                                         registry=r).labels(**labels)
        self.push_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes pushed prefill -> decode.", list(labels),
                                  registry=r).labels(**labels)
        gauge_labels, wr = [*labels, "worker"], self.worker_registry
        self.role = Gauge("pdserve:worker_role", "1 for each worker's role now: prefill, decode, or "
                          "decode_every_prompt (a decode worker computing every prompt: no prefill worker left).",
                          [*gauge_labels, "role"],
                          registry=wr)
        self.kv_usage = Gauge("pdserve:kv_cache_usage_perc", "Fraction of a worker's KV blocks in use (0-1).",
                              gauge_labels, registry=wr)
        self.leases = Gauge("pdserve:kv_leases", "Open KV leases of a decode worker.", gauge_labels, registry=wr)
        self.pushes = Gauge("pdserve:kv_pushes", "KV pushes a prefill worker finished well, since start.",
                            gauge_labels, registry=wr)
        self.push_failures = Gauge(
            "pdserve:kv_push_failures", "KV pushes that failed (each request moved on by its decode worker's report), "
            "since start.", gauge_labels, registry=wr)
        self.push_cancellations = Gauge(
            "pdserve:kv_push_cancellations", "KV pushes whose requests were aborted (a client that left) before they "
            "finished, since start.", gauge_labels, registry=wr)
        self.push_seconds = Gauge(
            "pdserve:kv_push_seconds", "The finished pushes' seconds (first token -> sends done), summed since start.",
            gauge_labels, registry=wr)
        self.push_send_device_seconds = Gauge(
            "pdserve:kv_push_send_device_seconds", "The finished pushes' sends on the device (CUDA events; with tensor "
            "parallelism rank 0's), summed since start; 0 where not timed.", gauge_labels, registry=wr)
        self.spec_drafts = Gauge("pdserve:spec_decode_num_draft_tokens", "Drafted tokens verified, since start.",
                                 gauge_labels, registry=wr)
        self.spec_accepted = Gauge("pdserve:spec_decode_num_accepted_tokens", "Drafted tokens accepted, since start.",
                                   gauge_labels, registry=wr)
        # the gauges each worker's stats row sets field for field: (its field, the gauge)
        self._row_gauges = [(field, Gauge(name, help_text, gauge_labels, registry=wr))
                            for field, name, help_text in ROW_GAUGES]
        self._worker_gauges = [self.role, self.kv_usage, self.leases, self.pushes, self.push_failures,
                               self.push_cancellations, self.push_seconds, self.push_send_device_seconds,
                               self.spec_drafts, self.spec_accepted, *(gauge for _, gauge in self._row_gauges)]

    # ---- RouterMetrics
    def on_choice_finished(
        self, *, finish_reason: str, num_prompt_tokens: int, num_completion_tokens: int,
        num_cached_tokens: int, time_to_first_token_s: float | None, elapsed_s: float,
    ) -> None:
        self.success.labels(**self._labels, finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_tokens.inc(num_cached_tokens)
        self.generation_tokens.inc(num_completion_tokens)
        self.e2e.observe(elapsed_s)
        if time_to_first_token_s is not None:
            self.ttft.observe(time_to_first_token_s)
            if num_completion_tokens > 1:
                self.tpot.observe((elapsed_s - time_to_first_token_s) / (num_completion_tokens - 1))

    def on_inter_token(self, *, gap_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def on_rejected(self, *, status_code: int) -> None:
        self.rejected.labels(**self._labels, status_code=str(status_code)).inc()

    def on_response(self, *, route: str, status_code: int, elapsed_s: float) -> None:
        self.responses.labels(**self._labels, route=route, status_code=str(status_code)).inc()

    def on_prefill_result(self, result: PrefillResultMsg) -> None:
        if result.push_bytes:
            self.push_bytes.inc(result.push_bytes)

    # ---- scrape
    async def render(self, timeout_s: float = 2.0) -> bytes:
        if self.worker_stats is not None:
            try:
                rows = await asyncio.wait_for(self.worker_stats(), timeout_s)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - a scrape never fails for one slow worker
                rows = []
            # NOTE: every scrape sets the workers' series afresh: a worker that left, changed role or did not
            # answer in time keeps no series of before (a stale value would read as a live one)
            for gauge in self._worker_gauges:
                gauge.clear()
            for row in rows:
                w = {**self._labels, "worker": row.worker_id}
                role = "decode_every_prompt" if row.computes_every_prompt else row.role
                self.role.labels(**w, role=role).set(1)
                for field, gauge in self._row_gauges:
                    gauge.labels(**w).set(getattr(row, field))
                blocks = max(1, row.num_blocks)
                self.kv_usage.labels(**w).set((row.num_blocks - row.num_free_blocks) / blocks)
                if row.role == "prefill":
                    totals = row.push_totals
                    self.pushes.labels(**w).set(totals.num_pushed)
                    self.push_failures.labels(**w).set(totals.num_failed)
                    self.push_cancellations.labels(**w).set(totals.num_cancelled)
                    self.push_seconds.labels(**w).set(totals.push_seconds)
                    self.push_send_device_seconds.labels(**w).set(totals.send_device_seconds)
                else:
                    self.leases.labels(**w).set(row.num_leases)
                    self.spec_drafts.labels(**w).set(row.num_spec_draft_tokens)
                    self.spec_accepted.labels(**w).set(row.num_spec_accepted_tokens)
        own = self.shared.summed() if self.shared is not None else generate_latest(self.registry)
        return own + generate_latest(self.worker_registry)
