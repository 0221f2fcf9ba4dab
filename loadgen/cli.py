"""The command line of `pdserve bench` (and `python -m loadgen`): flags from BenchConfig, then
a probe request, one run per request rate (one, or a sweep), the summary on stdout, the progress bar
on stderr, and the JSON and PNG where --out says.

Every run checks itself before it is reported: each record is self-consistent (TTFT <= E2E), counts
reconcile, throughputs are counts / duration; a failure stops the command with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from loadgen.config import BenchConfig

_FLAGS = {"is_progress": "--progress"}  # field -> flag, where the flag is not --field-name


class BenchError(RuntimeError):
    """The benchmark could not run (the server is unreachable, refuses the probe) or checked false."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per BenchConfig field, with its default and its description as help."""
    for name, info in BenchConfig.model_fields.items():
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        default = os.environ.get("PDSERVE_API_KEY") if name == "api_key" else info.default
        kind, choices = _flag_type(info.annotation)
        help_text = (info.description or "").replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        if isinstance(default, tuple) and len(default) == 2 and name.endswith("_len"):
            shown = str(default[0]) if default[0] == default[1] else f"{default[0]}:{default[1]}"
        if name == "api_key":
            help_text += " (default: $PDSERVE_API_KEY)"
        elif default is not None and default != "":
            help_text += f" (default: {shown})"
        parser.add_argument(flag, dest=name, type=kind, choices=choices, default=default, help=help_text)


def _flag_type(annotation: Any) -> tuple[Callable[[str], Any] | type, list[str] | None]:
    """(argparse type, choices) of a field: the first non-None member of a union; tuples stay str
    (BenchConfig parses '64:256' and '1,2,4')."""
    args = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0]
    if typing.get_origin(base) is Literal:
        return str, [str(c) for c in typing.get_args(base)]
    if base in (bool, int, float, str, Path):
        return base, None
    return str, None


def build_parser(prog: str = "python -m loadgen") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Load generator for OpenAI-compatible servers: "
                                     "TTFT, TPOT, ITL, E2E, throughput and goodput under SLOs.")
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{name: getattr(args, name) for name in BenchConfig.model_fields})


@dataclass(frozen=True)
class BenchResult:
    runs: list[Any]  # report.RateRun, one per request rate
    json_path: Path | None
    png_path: Path | None


async def _probe(client: Any, clock: Callable[[], float]) -> None:
    """One small request before the run: fail fast, and clearly, when the server cannot serve it."""
    from loadgen.workloads import BenchRequest

    record = await client.send(-1, BenchRequest("Hello", 2), clock())
    if not record.is_success:
        status = f"HTTP {record.http_status}" if record.http_status is not None else "no HTTP answer"
        raise BenchError(f"the probe request to {client.url} failed ({status}: {record.error}); is the server up, "
                         "and are --base-url, --api-key and --model right?")


def client_for(config: BenchConfig, *, clock: Callable[[], float] = time.perf_counter) -> Any:
    """The OpenAIStreamClient CONFIG describes (server, model, endpoint, key, ignore_eos, timeout); open it
    with `async with`."""
    from loadgen.client import OpenAIStreamClient

    return OpenAIStreamClient(config.base_url, model=config.model, endpoint=config.endpoint,
                              api_key=config.api_key, ignore_eos=config.ignore_eos,
                              temperature=config.temperature, timeout_s=config.request_timeout, clock=clock)


async def run_rate(client: Any, config: BenchConfig, k: int, rate: float, *,
                   clock: Callable[[], float] = time.perf_counter) -> Any:
    """The run of CONFIG's workload at RATE, the K-th of a sweep (seed: config.seed + k), its records
    checked: a report.RateRun. CLIENT is an open OpenAIStreamClient (or anything with its `send`)."""
    from loadgen.arrivals import arrival_offsets
    from loadgen.metrics import SLO, MetricsError, check_metrics, compute_metrics
    from loadgen.records import RecordError
    from loadgen.report import RateRun
    from loadgen.runner import Progress, run_requests
    from loadgen.workloads import build_workload

    # NOTE: a fresh seed per rate: the same prompts again would hit the server's prefix cache.
    seed = config.seed + k
    requests = build_workload(config, seed)
    offsets = arrival_offsets(len(requests), rate, burstiness=config.burstiness, seed=seed)
    progress = Progress(len(requests), label=f"{rate:g} req/s", is_enabled=config.is_progress)
    result = await run_requests(requests, offsets, client.send, max_concurrency=config.max_concurrency,
                                duration=config.duration, clock=clock, progress=progress)
    try:
        metrics = compute_metrics(result.records, result.duration_s, SLO(config.slo_ttft_ms, config.slo_tpot_ms))
        check_metrics(metrics, result.records)
    except (RecordError, MetricsError) as err:
        raise BenchError(f"the run at {rate:g} req/s failed its own check: {err}") from err
    if result.num_planned != len(result.records) + result.num_not_sent:
        raise BenchError(f"planned {result.num_planned} != sent {len(result.records)} + "
                         f"not sent {result.num_not_sent}")
    return RateRun(rate, seed, result.num_not_sent, result.is_capped, metrics, result.records)


async def run_benchmark(config: BenchConfig, *, clock: Callable[[], float] = time.perf_counter,
                        echo: Callable[[str], None] = print) -> list[Any]:
    """Probes the server, then runs the workload at each rate of CONFIG; each run's records checked."""
    from loadgen.report import summary

    runs = []
    async with client_for(config, clock=clock) as client:
        await _probe(client, clock)
        for k, rate in enumerate(config.rates):
            run = await run_rate(client, config, k, rate, clock=clock)
            runs.append(run)
            echo(summary(run))
    return runs


def bench(config: BenchConfig, **kwargs: Any) -> BenchResult:
    """Runs CONFIG and writes its JSON and PNG where config.out says (nothing is written without it)."""
    from loadgen.report import environment, write_results

    runs = asyncio.run(run_benchmark(config, **kwargs))
    if config.out is None:
        return BenchResult(runs, None, None)
    json_path, png_path = write_results(config.out, config, environment(config), runs)
    print(f"wrote {json_path} and {png_path}")
    return BenchResult(runs, json_path, png_path)


def run_command(args: argparse.Namespace) -> int:
    """`pdserve bench` with parsed ARGS: 0 on success, 2 for bad options, 1 for a failed run."""
    from loadgen.workloads import WorkloadError

    try:
        config = config_from_args(args)
    except ValidationError as err:
        print(f"pdserve bench: bad options:\n{err}", file=sys.stderr)
        return 2
    try:
        bench(config)
    except (BenchError, WorkloadError) as err:
        print(f"pdserve bench: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))
