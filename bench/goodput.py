"""Goodput of disaggregated serving against colocated replicas on the same two GPUs (project issue 9).

For each mode in turn this starts `pdserve serve` as a subprocess (its own local Ray cluster):

  disagg     1 prefill + 1 decode worker; the prompt's KV goes over NCCL (gloo on the CPU)
  colocated  2 colocated replicas, each doing chunked prefill and decode on its own GPU
  adaptive   starts as 1P1D and steers to the SLOs it is scored against (--slo-*): each prompt is
             prefilled where its first token comes sooner (the 'slo' prefill rule: through the prefill
             worker, or on the decode worker in chunks within the step budget), and the autoscaler may
             move a worker between the pools (issue 24)

waits for /v1/models, warms it up (a few prompts of the workload's lengths, then --warmup-load-s of load at
the first rate, unscored: on 2x H200 a colocated sweep's first rate, after the prompts alone, saw TTFTs
up to 2.7 s in its first 2 s), sweeps Poisson request
rates with loadgen/ (random token-id prompts, ignore_eos; per rate SECONDS_PER_RATE seconds of
arrivals, then the requests drain for at most DRAIN_S, after which those still running count as
failed; by default DRAIN_S is the longest a request can take and still meet both SLOs, + 1 s), then stops it (SIGINT, SIGTERM, SIGKILL; then whatever of its process group remains, Ray's
processes, by group id). A mode that fails (start, warm-up, a rate, the server dying) is recorded with
its phase, error and log tail, and the other mode still runs. A mode's sweep stops after a rate where
fewer than MIN_ATTAINMENT of the requests met the SLOs: higher rates would only queue more.
Goodput is vLLM's; bench/goodput_report.py has the definitions and the comparison (best goodput of
each mode over the sweep, disagg / colocated, against the 2x goal).

Time: everything runs inside --budget-s. Each mode gets an equal share of what is left when it starts
(a mode that ends early leaves its time to the next); a rate starts only if it fits, with room to
stop the server; every phase has a timeout. The server gets --exit-after as a last resort.

Writes to --out (5 files): goodput_<device>.json (written after each mode, so a partial run keeps what
it measured; per-request summaries included), goodput_<device>.png, goodput_driver.log (this
driver's output with each rate's full summary), server_<mode>.log (the server's output, then the
tails of Ray's worker and Serve logs). `--replot FILE.json` draws the PNG of a run again (where the
machine that ran it had no matplotlib).

Models without tokenizer.json (bench/shapes/*: config.json only): the router needs a tokenizer to
check token ids against the vocabulary and to stream text, so the driver serves a copy of the shape
with an id-only tokenizer (one word-level token per id, 't<id>'); the prompts are token ids anyway.

GPU run (2x H200; device kind nvidia-h200-x2; one command, 10 minutes in all). Ray comes from the
bundle; carry [".raybundle", "router/proto/pdserve_pb2.py", "router/proto/pdserve_pb2_grpc.py"] (the
gRPC code is generated, git-ignored, and the machine has no grpcio-tools to generate it):

    bash -c 'tar -xJf .raybundle/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=0 TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_ENABLE_MONITORING=0 && nvidia-smi -L && timeout 570 python3 -m bench.goodput --out "$OUT"'

The defaults are that run: bench/shapes/llama-3.1-8b with dummy weights in bfloat16, the engine's
attention default ('auto': Triton on CUDA, with CUDA graphs for decode steps), max_model_len 4,300
(the longest request; decode graphs are sized by it), the engine's batching defaults (64 sequences,
2,048 tokens a step); prompts of 1,000-4,000 tokens, outputs of 100-300; SLOs TTFT <= 1 s and
TPOT <= 40 ms per request; rates 2,4,8,12,16 req/s with 20 s of arrivals each (+ <= 14 s drain:
1 s + 299 x 40 ms + 1 s).

Why those rates. pdserve's own figures: on 2x H200 (bench/results/disagg_2xh200.json) a
2,048-token Llama-3.1-8B prompt takes 51 ms on the prefill worker plus a 6.4 ms KV push (256 MiB),
TTFT 65 ms against 56 ms colocated; on an H100 a 2,048-token prefill step runs at 80 % of the bf16
matmul peak. So a 2,500-token prompt is ~65-70 ms and one prefill GPU saturates near 14 req/s,
TTFT's p90 rising before that. A decode step at batch ~30 with ~2,600 tokens of context
reads 16 GB of weights and ~10 GB of KV (0.13 MB a token), ~7-9 ms at the H200's 4.3 TB/s, so the
decode GPU holds TPOT far under 40 ms up to ~20 req/s (64 sequences at most). The two colocated
replicas have twice the prefill capacity, but each 2,048-token chunk stalls their decode steps
by ~55 ms (p99 ITL) and a share of every TPOT. So both knees may lie near 10-16 req/s if the
serving path (Ray, Serve's proxy, the router) adds little; 2 req/s is the anchor if it adds much.
A mode stops at the first rate where fewer than half its requests meet the SLOs.
Time: Ray + Serve ~20 s, pools ~15 s (bench/results/nccl_kill_2xh200.json) and CUDA graph
capture, warm-up (Triton compiles) 10-30 s, stop ~10 s: 60-100 s a mode; 5 rates x (20 s + 3-14 s) = 115-170 s a mode; both
~350-530 s. --budget-s 510 (from after imports) keeps the whole under `timeout 570`: a mode gets
half of the time left when it starts, and a rate that would not fit is skipped and recorded as such.

CPU smoke run (the embedded model, gloo transport; about 2.5 minutes on 2 cores):

    python -m bench.goodput --out /tmp/goodput-cpu --model default --load-format auto --dtype float32 \\
        --device cpu --rates 1,2 --seconds-per-rate 20 \\
        --input-len 64:256 --output-len 16:48 --num-warmup 2 --budget-s 400 --label "CPU SMOKE RUN"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import torch

from bench.common import device_name, device_slug, model_label, save_plot, title, write_results
from bench.goodput_modes import MODE_NAMES, ModeSpec, layout_of, mode_spec, plan_adaptive_modes
from bench.goodput_report import ModeResult, compare, mode_summary, plot, scaleout, table
from bench.rate_step import parse_schedule, step_run
from bench.server_process import (
    ROOT,
    ServerError,
    ServerProcess,
    cluster_status,
    error_lines,
    ray_log_tails,
    ray_session_dir,
    scrape_metrics,
    wait_gpus_free,
)
from bench.worker_timeline import poll_workers, role_changes
from deploy.cli import add_engine_flags, engine_options
from engine.rank import resolve_device, resolve_model_dir
from engine.models import load_arch
from kvtransfer.netaddr import free_port
from loadgen.config import BenchConfig, parse_range

SHAPES = ROOT / "bench" / "shapes"
STOP_RESERVE_S = 15.0  # kept free at the end of a mode's share: stopping the server, collecting its logs
FINAL_RESERVE_S = 10.0  # kept free at the end of the budget: the JSON and the plot


# ---- the command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n")[0])
    add_engine_flags(parser)  # the same engine flags as `pdserve serve`, passed on to it
    parser.set_defaults(model=str(SHAPES / "llama-3.1-8b"), load_format="dummy", dtype="bfloat16")
    a = parser.add_argument
    a("--out", type=Path, help="Folder for the results and logs (required unless --replot).")
    a("--replot", type=Path, help="Only draw the PNG of this goodput JSON again, beside it, and exit.")
    a("--modes", default="disagg,colocated", help=f"Comma-separated, run in this order: {MODE_NAMES}.")
    a("--transport", default="auto", help="KV transport of the disagg mode: auto (nccl with GPUs, gloo without).")
    a("--rates", default="2,4,8,12,16", help="Poisson request rates (req/s), comma-separated, in increasing order.")
    a("--seconds-per-rate", type=float, default=20.0, help="Seconds of arrivals at each rate.")
    a("--schedule", default=None, help="RATE:SECONDS,... (e.g. 4:60,16:60,4:60): instead of the sweep, one continuous "
      "run whose Poisson rate changes at those times, scored by bench/rate_step.py (transitions, attainment outside "
      "them, lost requests), with each worker's role polled from /metrics.")
    a("--drain-s", type=float, default=None, help="Longest wait for requests after the arrivals end; default: "
      "the longest a request can take within both SLOs, TTFT + (max output - 1) x TPOT, + 1 s.")
    a("--input-len", default="1000:4000", help="Prompt tokens, N or MIN:MAX (uniform).")
    a("--output-len", default="100:300", help="Output tokens (max_tokens, ignore_eos), N or MIN:MAX (uniform).")
    a("--slo-ttft-ms", type=float, default=1000.0, help="Goodput SLO on time to first token.")
    a("--slo-tpot-ms", type=float, default=40.0, help="Goodput SLO on time per output token.")
    a("--max-in-flight", type=int, default=None, help="`pdserve serve --max-in-flight` for every mode (each router "
      "replica's admission limit; default: the server's). At --max-num-seqs 256 on 2 workers the default 256 refused "
      "requests before the engines were full.")
    a("--min-attainment", type=float, default=0.5,
      help="Stop a mode's sweep after a rate where fewer than this fraction of requests met the SLOs.")
    a("--num-warmup", type=int, default=4, help="Warm-up requests (prompt lengths across --input-len).")
    a("--warmup-load-s", type=float, default=5.0,
      help="Then this long of load at the first rate, unscored (its attainment goes to the log): the engines' "
      "first steps of the workload's shapes (Triton's compiles of each) are not counted in the first rate.")
    a("--budget-s", type=float, default=510.0, help="Wall time for everything; rates that do not fit are skipped.")
    a("--start-timeout-s", type=float, default=180.0, help="Longest wait for a server to answer /v1/models.")
    a("--warmup-timeout-s", type=float, default=150.0, help="Longest warm-up (first Triton compiles).")
    a("--stop-timeout-s", type=float, default=30.0, help="Longest wait after SIGINT before SIGTERM, then SIGKILL.")
    a("--seed", type=int, default=0, help="Seed of prompts and arrivals (rate k uses SEED + k, in both modes).")
    a("--plan-profile", type=Path, default=None,
      help="A StepProfile JSON (pdserve plan --profile): adaptive modes start in the layout the planner picks from it "
      "for this workload and SLOs on their GPUs (default: 1P1D), and the pick and its predicted goodput are recorded.")
    a("--label", default="", help="A note for the title and the JSON (e.g. 'CPU SMOKE RUN').")
    return parser


def serve_flags(options: dict[str, Any]) -> list[str]:
    """Engine options (deploy.cli.engine_options) back into `pdserve serve` flags; None: the default."""
    flags: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def mode_share(now: float, end: float, num_modes_left: int) -> float:
    """The deadline of the next mode: an equal share of the time left for the modes left."""
    return now + max(0.0, end - now) / max(1, num_modes_left)


def slo_drain_s(slo_ttft_ms: float, slo_tpot_ms: float, output_len: tuple[int, int]) -> float:
    """The longest a request can take and still meet both SLOs (TTFT, then max output - 1 tokens at TPOT),
    + 1 s, rounded up: waiting this long after the last arrival cuts off no request that would be good."""
    return float(math.ceil((slo_ttft_ms + (output_len[1] - 1) * slo_tpot_ms) / 1e3 + 1.0))


def num_prompts(rate: float, seconds: float) -> int:
    return max(1, round(rate * seconds))


# ---- the model directory the server reads
def id_only_tokenizer(vocab_size: int) -> dict[str, Any]:
    """tokenizer.json of a word-level tokenizer with one token per id ('t0', 't1', ...) and 't0' for
    unknown words: token ids pass the router's vocabulary check and stream as non-empty text."""
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)}, "unk_token": "t0"},
    }


def servable_model_dir(model_dir: Path, scratch: Path) -> Path:
    """MODEL_DIR itself when it has tokenizer.json; else a copy of its JSON configs in SCRATCH with an
    id-only tokenizer (a config-only shape with dummy weights)."""
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    dest = scratch / f"{model_dir.name}-ids"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, dest / name)
    vocab_size = load_arch(model_dir).vocab_size
    (dest / "tokenizer.json").write_text(json.dumps(id_only_tokenizer(vocab_size)))
    return dest


# ---- one mode
@dataclass(frozen=True)
class Plan:
    """What every mode runs: the server's engine flags, the workload and the sweep."""

    engine_flags: tuple[str, ...]
    transport: str
    model_name: str  # the model directory the server reads; also the `model` of requests
    vocab_size: int
    is_cuda: bool
    rates: tuple[float, ...]
    seconds_per_rate: float
    drain_s: float
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    slo_ttft_ms: float
    slo_tpot_ms: float
    min_attainment: float
    num_warmup: int
    seed: int
    start_timeout_s: float
    warmup_timeout_s: float
    stop_timeout_s: float
    schedule: tuple[tuple[float, float], ...] = ()  # a rate step instead of the sweep (bench/rate_step.py)
    warmup_load_s: float = 0.0  # after the warm-up requests, this long of unscored load at the first rate
    max_in_flight: int | None = None  # `pdserve serve --max-in-flight`; None: the server's default

    @property
    def first_rate(self) -> float:
        return self.schedule[0][0] if self.schedule else self.rates[0]

    def server_argv(self, mode: ModeSpec, port: int, grpc_port: int, exit_after_s: float) -> list[str]:
        transport = ["--transport", self.transport] if mode.is_kv_transferred else []
        slos = ["--slo-ttft-ms", f"{self.slo_ttft_ms:g}",
                "--slo-tpot-ms", f"{self.slo_tpot_ms:g}"] if mode.steers_to_slos else []
        admission = ["--max-in-flight", str(self.max_in_flight)] if self.max_in_flight is not None else []
        return [sys.executable, "-m", "deploy.cli", "serve", *mode.serve_flags, *self.engine_flags, *transport, *slos,
                *admission, "--port", str(port), "--grpc-port", str(grpc_port), "--exit-after", f"{exit_after_s:.0f}"]

    def server_env(self) -> dict[str, str]:
        from kvtransfer import NCCL_WORKER_ENV

        env = {**os.environ, **NCCL_WORKER_ENV, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        if not self.is_cuda:
            env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # 2 workers share a few CPU cores
        return env

    def bench_config(self, base_url: str, rate: float) -> BenchConfig:
        window = self.seconds_per_rate + self.drain_s
        return BenchConfig(
            base_url=base_url, model=self.model_name, input_len=self.input_len, output_len=self.output_len,
            vocab_size=self.vocab_size, num_prompts=num_prompts(rate, self.seconds_per_rate), seed=self.seed,
            duration=window, request_timeout=window + 10, slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms,
            is_progress=False,
        )


WARMUP_SEED_OFFSET = 20_000  # the warm-up load's prompts: seed + this, none of a rate's (seed + k)


async def warm_up(plan: Plan, base_url: str, timeout_s: float) -> dict[str, Any] | None:
    """The first request alone, retried until the router has workers, then the rest at once; prompt
    lengths spread over the workload's (first Triton compiles, NCCL's first transfers). Then
    plan.warmup_load_s of the workload at the first rate (prompts of their own seed), unscored: its
    rate_row, or None without it."""
    from bench.goodput_report import rate_row
    from loadgen.cli import client_for, run_rate
    from loadgen.workloads import random_workload

    deadline = time.monotonic() + timeout_s
    requests = random_workload(plan.num_warmup, plan.input_len, (16, 16), seed=plan.seed + 10_000,
                               vocab_size=plan.vocab_size)
    async with client_for(plan.bench_config(base_url, 1.0)) as client:
        while not (record := await client.send(0, requests[0], time.perf_counter())).is_success:
            if time.monotonic() > deadline:
                raise ServerError(f"warm-up: no request served within {timeout_s:.0f} s; last error: "
                                  f"HTTP {record.http_status}: {record.error}")
            await asyncio.sleep(1.0)
        records = await asyncio.wait_for(
            asyncio.gather(*(client.send(i, r, time.perf_counter()) for i, r in enumerate(requests[1:], 1))),
            max(1.0, deadline - time.monotonic()))
    failed = [r for r in records if not r.is_success]
    if failed:
        raise ServerError(f"warm-up: {len(failed)} of {len(records)} requests failed: HTTP {failed[0].http_status}: "
                          f"{failed[0].error}")
    if plan.warmup_load_s <= 0:
        return None
    rate = plan.first_rate
    config = plan.bench_config(base_url, rate).model_copy(update={
        "num_prompts": num_prompts(rate, plan.warmup_load_s), "duration": plan.warmup_load_s + plan.drain_s,
        "request_timeout": plan.warmup_load_s + plan.drain_s + 10})
    async with client_for(config) as client:
        run = await asyncio.wait_for(run_rate(client, config, WARMUP_SEED_OFFSET, rate),
                                     max(1.0, deadline - time.monotonic()))
    return rate_row(run)


async def sweep(plan: Plan, result: ModeResult, server: ServerProcess, base_url: str, deadline: float,
                echo: Callable[[str], None], note: Callable[[str], None],
                checkpoint: Callable[[ModeResult], None]) -> None:
    """Every rate that fits before DEADLINE, into RESULT.runs; stops after one where the SLOs mostly failed."""
    from bench.goodput_report import rate_row
    from loadgen.cli import client_for, run_rate
    from loadgen.report import summary

    for k, rate in enumerate(plan.rates):
        window = plan.seconds_per_rate + plan.drain_s
        if time.monotonic() + window + STOP_RESERVE_S > deadline:
            result.skipped[f"{rate:g}"] = "out of time"
            continue
        result.phase = f"rate {rate:g}"
        started = time.monotonic()
        config = plan.bench_config(base_url, rate)
        async with client_for(config) as client:
            run = await asyncio.wait_for(run_rate(client, config, k, rate), window + 30)
        result.phases_s[result.phase] = round(time.monotonic() - started, 1)
        result.runs.append(run)
        checkpoint(result)
        row = rate_row(run)
        note(summary(run))
        echo(f"{result.mode} {rate:g} req/s: goodput {row['goodput']:.2f}, SLO attainment {row['slo_attainment']:.0%}, "
             f"TTFT p90 {row['ttft_p90_ms'] or 0:.0f} ms, TPOT p90 {row['tpot_p90_ms'] or 0:.1f} ms, "
             f"ITL p99 {row['itl_p99_ms'] or 0:.1f} ms, {row['num_completed']}/{row['num_planned']} done, "
             f"{row['num_errored']} errors ({time.monotonic() - started:.0f} s)")
        server.check_alive()
        if row["slo_attainment"] < plan.min_attainment:
            for later in plan.rates[k + 1:]:
                result.skipped[f"{later:g}"] = f"saturated: {row['slo_attainment']:.0%} within SLO at {rate:g} req/s"
            return


def run_mode(plan: Plan, mode: ModeSpec, out_dir: Path, deadline: float, echo: Callable[[str], None],
             note: Callable[[str], None], checkpoint: Callable[[ModeResult], None] = lambda result: None) -> ModeResult:
    """Start, wait, warm up, sweep, stop: one mode, never raising; a failure is recorded in the result.
    CHECKPOINT sees the result after each rate and before the server is stopped (to save what was measured).
    A start that failed because a port it was given was taken meanwhile (free_port's port is free when
    asked, and Ray's own processes bind random ports) is tried once more with other ports."""
    result = _run_mode_once(plan, mode, out_dir, deadline, echo, note, checkpoint)
    if result.phase == "start" and result.status == "failed" and any(
            taken in line for line in [result.error or "", *result.log_tail] for taken in PORT_TAKEN):
        echo(f"{mode.name}: a port was taken before the server bound it; starting again on other ports")
        result = _run_mode_once(plan, mode, out_dir, deadline, echo, note, checkpoint)
    return result


# the HTTP server's error, the router's gRPC server's, and the driver's own (another process answered on the port)
PORT_TAKEN = ("Address already in use", "gRPC cannot bind", "PortTakenError")


def _run_mode_once(plan: Plan, mode: ModeSpec, out_dir: Path, deadline: float, echo: Callable[[str], None],
                   note: Callable[[str], None], checkpoint: Callable[[ModeResult], None]) -> ModeResult:
    port, grpc_port = free_port(), free_port()
    exit_after = max(60.0, deadline - time.monotonic() + 60.0)
    argv = plan.server_argv(mode, port, grpc_port, exit_after)
    result = ModeResult(mode.name, mode.description, argv[1:])
    base_url = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"server_{mode.name}.log"
    log_path.write_text(f"$ {' '.join(argv)}\n")
    echo(f"{mode.name}: starting the server (log: {log_path.name})")
    server: ServerProcess | None = None
    phase_started = time.monotonic()
    try:
        result.phase = "start"
        server = ServerProcess(argv, plan.server_env(), log_path)
        server.wait_ready(base_url + "/v1/models",
                          min(plan.start_timeout_s, deadline - time.monotonic() - STOP_RESERVE_S))
        result.phases_s["start"] = round(time.monotonic() - phase_started, 1)
        echo(f"{mode.name}: serving after {result.phases_s['start']:.0f} s; warming up")
        result.phase, phase_started = "warm-up", time.monotonic()
        timeout_s = min(plan.warmup_timeout_s, deadline - time.monotonic() - STOP_RESERVE_S)
        load = asyncio.run(asyncio.wait_for(warm_up(plan, base_url + "/v1", timeout_s), timeout_s + 5))
        result.phases_s["warm-up"] = round(time.monotonic() - phase_started, 1)
        if load is not None:
            echo(f"{mode.name}: warm-up load {load['rate']:g} req/s for {plan.warmup_load_s:g} s (unscored): "
                 f"{load['slo_attainment']:.0%} within SLO, TTFT p90 {load['ttft_p90_ms'] or 0:.0f} ms")
        run = step_run if plan.schedule else sweep
        before = scrape_metrics(base_url) if mode.is_kv_transferred else ""
        rates_started_wall = time.time()  # NOTE: the timeline's t_s counts from here too (perf_counter)
        asyncio.run(_with_timeline(run(plan, result, server, base_url + "/v1", deadline, echo, note, checkpoint),
                                   base_url, result.timeline))
        if len(changes := role_changes(result.timeline)) > 1:
            echo(f"{mode.name}: the workers' roles changed (seconds from the first rate's start): "
                 + "; ".join(f"at {c['t_s']:.0f} s ({phase_at(c['t_s'], result.phases_s)}) {c['roles']}"
                             for c in changes))
        if mode.is_kv_transferred:
            result.pushes = push_totals(scrape_metrics(base_url), before)
            echo(f"{mode.name}: KV pushes while the rates ran: {result.pushes}")
        # NOTE: every pool's workers, draining ones too, and their engines (weights, KV dtype, TP and all-reduce
        # path); with an autoscaler its decisions
        autoscaled = "--autoscale-max-gpus" in argv
        trace_path = log_path.with_name(f"autoscaler_trace_{mode.name}.json") if autoscaled else None
        result.cluster_status = cluster_status(log_path, plan.server_env(), trace=trace_path)
        echo(f"{mode.name}: pdserve status after the rates:\n  " + "\n  ".join(result.cluster_status))
        if trace_path is not None:
            result.autoscaler_trace = autoscaler_trace(trace_path, rates_started_wall)
        result.status, result.phase = "ok", "done"
    except Exception as err:  # noqa: BLE001 - recorded; the next mode must still run
        result.fail(err)
        echo(f"{mode.name}: FAILED in phase {result.phase!r}: {result.error}")
    finally:
        checkpoint(result)
        if server is not None:
            _stop(server, plan, result, echo)
    if result.status != "ok" or any(run.metrics.num_errored for run in result.runs):
        echo(f"---- {log_path.name}: the server's last lines, then the errors in Ray's logs\n"
             + "\n".join(result.log_tail))
    return result


def autoscaler_trace(path: Path, rates_started_wall: float) -> list[dict[str, Any]]:
    """The autoscaler's readings `pdserve status --trace` wrote to PATH, from the first rate's start on
    (t_s, seconds from RATES_STARTED_WALL, a time.time()); [] where it wrote none."""
    if not path.is_file():
        return []
    samples = json.loads(path.read_text())
    return [{"t_s": round(s["wall_s"] - rates_started_wall, 1), **{k: v for k, v in s.items() if k != "wall_s"}}
            for s in samples if s["wall_s"] >= rates_started_wall]


def phase_at(t_s: float, phases_s: dict[str, float]) -> str:
    """The rate phase ("rate 12") running T_S seconds after the first rate started, from the rate phases'
    durations in the order they ran; "after the rates" past their end."""
    end = 0.0
    for phase, seconds in phases_s.items():
        if phase.startswith("rate "):
            end += seconds
            if t_s < end:
                return phase
    return "after the rates"


async def _with_timeline(run: Awaitable[None], server_url: str, timeline: list[dict[str, Any]]) -> None:
    """RUN, with each worker's state polled into TIMELINE every second while it lasts."""
    poller = asyncio.get_running_loop().create_task(poll_workers(server_url, timeline, time.perf_counter()))
    try:
        await run
    finally:
        poller.cancel()


PUSH_SERIES = {"pdserve:kv_pushes": "num_pushed", "pdserve:kv_push_failures": "num_failed",
               "pdserve:kv_push_seconds": "push_seconds", "pdserve:kv_push_send_device_seconds": "send_device_seconds"}


def push_totals(after: str, before: str = "") -> dict[str, Any]:
    """The prefill workers' KV pushes between two /metrics pages, summed over the workers: how many, how
    many failed, their seconds (each from the first token to its sends done, pushes overlapping), the bytes
    the router counted, and bytes / seconds: what one push moved a second as served; bytes / the sends'
    seconds on the device: the wire's bandwidth (with TP, all rank pairs over rank 0's time)."""
    def sums(text: str) -> dict[str, float]:
        out = dict.fromkeys([*PUSH_SERIES.values(), "push_bytes"], 0.0)
        for name, value in re.findall(r"^(pdserve:kv_\w+?)(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE):
            key = "push_bytes" if name == "pdserve:kv_transfer_bytes" else PUSH_SERIES.get(name)
            if key is not None:
                out[key] += float(value)
        return out

    a, b = sums(after), sums(before)
    totals = {k: a[k] - b[k] for k in a}
    seconds, device = totals["push_seconds"], totals["send_device_seconds"]
    return {**totals, "gb_per_s": totals["push_bytes"] / seconds / 1e9 if seconds > 0 else None,
            "device_gb_per_s": totals["push_bytes"] / device / 1e9 if device > 0 else None}


NOISE = ("GET / 499", "disconnected, cancelling request")  # the proxy's lines for /v1/models polls before it serves


def _stop(server: ServerProcess, plan: Plan, result: ModeResult, echo: Callable[[str], None]) -> None:
    """Stops the server; appends Ray's log tails to its log; keeps its last lines and Ray's errors in RESULT."""
    started = time.monotonic()
    result.stopped = server.stop(plan.stop_timeout_s)
    own = [line for line in server.log_path.read_text(errors="replace").splitlines()
           if not any(n in line for n in NOISE)]
    session = ray_session_dir(server.proc.pid)
    tails = ray_log_tails(session) if session is not None else ""
    with server.log_path.open("a") as log:
        log.write(f"\n==== driver: server {result.stopped}\n")
        if session is not None:
            log.write(f"==== Ray logs of {session}\n{tails}\n")
    result.log_tail = own[-25:] + ["---- errors in Ray's logs:"] + error_lines(tails)
    if plan.is_cuda:
        result.stopped += "; " + wait_gpus_free(30.0)
    result.phases_s["stop"] = round(time.monotonic() - started, 1)
    echo(f"{result.mode}: server {result.stopped}")


def run_modes(specs: Mapping[str, ModeSpec], run_one: Callable[[str, float], ModeResult], end: float,
              on_result: Callable[[dict[str, ModeResult]], None] = lambda results: None) -> dict[str, ModeResult]:
    """RUN_ONE(name, deadline) for each mode, in order, each with an equal share of the time left before END;
    a mode that raises anyway is recorded as failed and the next one runs. ON_RESULT sees the results so far."""
    results: dict[str, ModeResult] = {}
    for i, (name, spec) in enumerate(specs.items()):
        deadline = mode_share(time.monotonic(), end, len(specs) - i)
        try:
            results[name] = run_one(name, deadline)
        except Exception as err:  # noqa: BLE001 - the driver's own bug must not cost the other mode
            results[name] = ModeResult(name, spec.description, [])
            results[name].fail(err)
        on_result(results)
    return results


# ---- the whole run
def preflight(device: torch.device, echo: Callable[[str], None], num_gpus_needed: int = 2) -> list[str]:
    """What would make every mode fail, found before any server starts: Ray missing, too few GPUs, the
    gRPC code missing (generated, not committed: carry router/proto/pdserve_pb2*.py to a machine without
    grpcio-tools). Copied files can look older than pdserve.proto; without grpcio-tools they are
    then taken as they are (touched, so that the server does not try to regenerate them)."""
    import importlib.util

    from router.proto import codegen

    problems = []
    if importlib.util.find_spec("ray") is None:
        problems.append("Ray is not importable: extract .raybundle/site.tar.xz and put it on PYTHONPATH")
    if device.type == "cuda" and torch.cuda.device_count() < num_gpus_needed:
        problems.append(f"the largest mode needs {num_gpus_needed} GPUs; this machine has {torch.cuda.device_count()}")
    missing = [f.name for f in codegen.OUTPUTS if not f.is_file()]
    has_protoc = importlib.util.find_spec("grpc_tools") is not None
    if missing and not has_protoc:
        problems.append(f"router/proto/{', '.join(missing)} missing and no grpcio-tools to generate them: run "
                        "`python -m router.proto.codegen` where it is installed and carry the files")
    elif codegen.is_stale() and not has_protoc:
        for f in codegen.OUTPUTS:
            os.utime(f)
        echo("note: router/proto/pdserve_pb2*.py looked older than pdserve.proto (copied?); used as they are")
    return problems


def environment(args: argparse.Namespace, device: torch.device, model_dir: Path, plan: Plan) -> dict[str, Any]:
    """Where and on what it ran, with the keys bench.common.title reads."""
    arch = load_arch(model_dir)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device.type == "cuda" else []
    return {
        "device": device.type,
        "device_name": device_name(device) + (f" x{len(gpus)}" if len(gpus) > 1 else ""),
        "gpus": gpus,
        "num_cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_version": torch.__version__,
        "python_version": sys.version.split()[0],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "model": {
            "name": model_label(args.model), "dir": model_label(model_dir), "served_dir": model_label(plan.model_name),
            "load_format": args.load_format,
            "dtype": args.dtype, "architecture": arch.architecture, "num_layers": arch.num_layers,
            "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size, "num_heads": arch.num_heads,
            "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab_size": arch.vocab_size,
            "num_params": arch.num_params,
        },
    }


def _compact_records(result: ModeResult) -> list[dict[str, Any]]:
    """Per request (ms): send, TTFT, TPOT, E2E, the longest gap between tokens; counts; the error if any."""
    out = []
    for run in result.runs:
        rows = []
        for r in run.records:
            ok = r.is_success
            rows.append({
                "i": r.index, "send_s": round(r.send_time, 3), "ok": ok,
                "ttft_ms": round(r.ttft * 1e3, 1) if ok else None,
                "tpot_ms": round(r.tpot * 1e3, 2) if ok and r.tpot is not None else None,
                "e2e_ms": round(r.e2e * 1e3, 1), "max_itl_ms": round(max(r.itls) * 1e3, 1) if ok and r.itls else None,
                "in": r.prompt_tokens, "out": r.completion_tokens, "max_tokens": r.max_tokens,
                **({"error": r.error[:200]} if not ok else {}),
            })
        out.append({"rate": run.request_rate, "seed": run.seed, "records": rows})
    return out


def results_record(plan: Plan, args: argparse.Namespace, results: dict[str, ModeResult],
                   specs: Mapping[str, ModeSpec], planned: Mapping[str, Any] | None = None) -> dict[str, Any]:
    summaries = {name: mode_summary(r) for name, r in results.items()}
    return {
        "config": {
            "modes": {name: specs[name].description for name in results},
            "engine_flags": list(plan.engine_flags), "transport": plan.transport, "rates": list(plan.rates),
            "seconds_per_rate": plan.seconds_per_rate, "drain_s": plan.drain_s, "input_len": list(plan.input_len),
            "output_len": list(plan.output_len), "ignore_eos": True, "arrivals": "Poisson",
            "prompts": "random token ids", "slo_ttft_ms": plan.slo_ttft_ms, "slo_tpot_ms": plan.slo_tpot_ms,
            "min_attainment": plan.min_attainment, "num_warmup": plan.num_warmup, "warmup_load_s": plan.warmup_load_s,
            "seed": plan.seed,
            "budget_s": args.budget_s, **({"planner": planned} if planned else {}),
        },
        "modes": summaries,
        "comparison": compare(summaries),
        "scaleout": scaleout(summaries, {name: layout_of(specs[name]) for name in results}),
        "requests": {name: _compact_records(r) for name, r in results.items()},
    }


class Tee:
    """Prints to stdout and appends to the driver log; `note` writes to the log only."""

    def __init__(self, path: Path, t0: float) -> None:
        self.file: TextIO = path.open("a")
        self.t0 = t0

    def echo(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f} s] {text}"
        print(line, flush=True)
        self.note(line)

    def note(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()


def make_plan(args: argparse.Namespace, device: torch.device, model_dir: Path, scratch: Path) -> Plan:
    input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    served = servable_model_dir(model_dir, scratch)
    options = engine_options(args)
    options["model"] = "default" if args.model == "default" else str(served)
    if options["max_model_len"] is None:  # the longest request, not the model's 128k (decode graphs size by it)
        options["max_model_len"] = input_len[1] + output_len[1]
    rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    if not rates or any(r <= 0 for r in rates) or list(rates) != sorted(rates):
        raise SystemExit(f"--rates: expected increasing rates > 0 like 1,2,4, got {args.rates!r}")
    return Plan(
        engine_flags=tuple(serve_flags(options)), transport=args.transport, model_name=options["model"],
        vocab_size=load_arch(model_dir).vocab_size, is_cuda=device.type == "cuda", rates=rates,
        seconds_per_rate=args.seconds_per_rate, input_len=input_len, output_len=output_len,
        drain_s=(args.drain_s if args.drain_s is not None
                 else slo_drain_s(args.slo_ttft_ms, args.slo_tpot_ms, output_len)),
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, min_attainment=args.min_attainment,
        num_warmup=max(1, args.num_warmup), seed=args.seed, start_timeout_s=args.start_timeout_s,
        warmup_timeout_s=args.warmup_timeout_s, stop_timeout_s=args.stop_timeout_s,
        schedule=parse_schedule(args.schedule) if args.schedule else (), warmup_load_s=max(0.0, args.warmup_load_s),
        max_in_flight=args.max_in_flight,
    )


def plot_title(env: dict[str, Any], config: dict[str, Any]) -> str:
    """bench.common.title's four lines (what, model, device, workload), the workload over two lines."""
    flags = config["engine_flags"]
    backend = flags[flags.index("--attention-backend") + 1] if "--attention-backend" in flags else "?"
    (in_lo, in_hi), (out_lo, out_hi) = config["input_len"], config["output_len"]
    what = f"goodput: {' vs '.join(config['modes'].values())}" + (f" ({env['label']})" if env.get("label") else "")
    workload = (f"random token-id prompts of {in_lo}-{in_hi} tokens -> {out_lo}-{out_hi} output tokens (ignore_eos), "
                f"Poisson arrivals, {config['seconds_per_rate']:g} s a rate\nSLOs per request TTFT <= "
                f"{config['slo_ttft_ms']:g} ms and TPOT <= {config['slo_tpot_ms']:g} ms (p90s shown); "
                f"{backend} attention")
    return title(what, env, workload)


def replot(json_path: Path) -> Path:
    """The PNG of a goodput JSON again, beside it (where the run's machine had no matplotlib)."""
    doc = json.loads(json_path.read_text())
    config, png_path = doc["config"], json_path.with_suffix(".png")

    def draw(fig: Any) -> None:
        plot(fig, doc["modes"], doc["comparison"], config["slo_ttft_ms"], config["slo_tpot_ms"])

    if not save_plot(png_path, draw, plot_title(doc["environment"], config)):
        raise SystemExit("replot needs matplotlib")
    return png_path


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # NOTE: unwinds through run_mode's `finally`, which stops the server


def main(argv: Sequence[str] | None = None) -> int:
    t0 = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        print(f"wrote {replot(args.replot)}")
        return 0
    if args.out is None:
        parser.error("--out is required")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not names:
        raise SystemExit(f"--modes: none given; choose from {MODE_NAMES}")
    try:
        specs = {m: mode_spec(m, args.tensor_parallel_size) for m in names}
    except ValueError as err:
        raise SystemExit(str(err)) from err
    planned = plan_adaptive_modes(args, specs, args.tensor_parallel_size) if args.plan_profile is not None else {}
    args.out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model)
    tee = Tee(args.out / "goodput_driver.log", t0)
    problems = preflight(device, tee.echo, max(spec.num_gpus for spec in specs.values()))
    if problems:
        tee.echo("goodput: cannot run:\n  " + "\n  ".join(problems))
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-goodput-") as scratch:
        plan = make_plan(args, device, model_dir, Path(scratch))
        env = environment(args, device, model_dir, plan)
        stem = f"goodput_{device_slug(device)}"
        load = (f"schedule {[f'{r:g}:{t:g}' for r, t in plan.schedule]} (req/s:s)" if plan.schedule
                else f"rates {list(plan.rates)} x {plan.seconds_per_rate:g} s")
        tee.echo(f"goodput: {env['device_name']}, model {args.model} -> {plan.model_name}; modes {names}; {load} "
                 f"(+ drain <= {plan.drain_s:g} s); budget {args.budget_s:g} s")

        def write_json(results: dict[str, ModeResult]) -> None:
            doc = {"benchmark": "goodput", "environment": env, **results_record(plan, args, results, specs, planned)}
            (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")

        done: dict[str, ModeResult] = {}

        def save(results: dict[str, ModeResult]) -> None:
            done.update(results)
            write_json(done)

        def run_one(name: str, deadline: float) -> ModeResult:
            return run_mode(plan, specs[name], args.out, deadline, tee.echo, tee.note,
                            checkpoint=lambda partial: write_json({**done, name: partial}))

        if planned:
            tee.echo("planner: " + "; ".join(f"{n}: {p['pick']} (predicted goodput "
                                             f"{p['predicted']['goodput']:.2f} req/s)"
                                             for n, p in planned.items()))
        results = run_modes(specs, run_one, t0 + args.budget_s - FINAL_RESERVE_S, on_result=save)
    record = results_record(plan, args, results, specs, planned)
    summaries, comparison = record["modes"], record["comparison"]
    json_path, png_path = write_results(
        args.out, "goodput", env, record,
        lambda fig: plot(fig, summaries, comparison, plan.slo_ttft_ms, plan.slo_tpot_ms),
        plot_title(env, record["config"]))
    tee.echo(f"wrote {json_path.name}, {png_path.name}; {time.monotonic() - t0:.0f} s in all")
    tee.echo("\n" + table(summaries, comparison))
    return 0 if all(r.status == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
