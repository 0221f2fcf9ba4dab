"""`pdserve plan`: the best layout of N GPUs for a workload and SLOs (cluster/planner/), from a
step profile read from --profile, or measured on this machine's engine and written there first;
prints every layout's predicted goodput and why, and writes the ServeAppConfig of the best one
(`pdserve serve --config` takes it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PREFILL_TOKENS = (128, 512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 128, 256)
DECODE_CONTEXTS = (256, 1024, 4096)
REPEATS = 3  # timed steps per prefill figure (their median)
DECODE_REPEATS = 16  # timed steps per decode figure: a step is milliseconds, and three read a point under its floor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, required=True,
                        help="GPUs to lay out (workers of the sizes the profiles were measured on)")
    parser.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token, per request")
    parser.add_argument("--slo-tpot-ms", type=float, required=True, help="time per output token, per request")
    parser.add_argument("--profile", type=Path, nargs="+", required=True,
                        help="StepProfile JSON files, one per worker size (tensor_parallel_size); a path that does "
                        "not exist is measured on this machine's engine (the engine flags, --tp included) and written "
                        "there")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(1000, 4000), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    parser.add_argument("--samples", type=Path, default=None,
                        help="JSONL of {\"prompt_tokens\": N, \"output_tokens\": M} to draw lengths from instead")
    parser.add_argument("--num-requests", type=int, default=600, help="requests simulated per rate")
    parser.add_argument("--out", type=Path, default=None, help="write the best layout's ServeAppConfig JSON here")


def _samples(path: Path | None) -> tuple[tuple[int, int], ...]:
    if path is None:
        return ()
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            try:
                out.append((int(row["prompt_tokens"]), int(row["output_tokens"])))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}:{n}: each line needs integer prompt_tokens and output_tokens") from None
    return tuple(out)


def _profiles(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[int, Any]:
    """The profiles by worker size; two of one size are refused, naming both files."""
    out: dict[int, Any] = {}
    where: dict[int, Path] = {}
    for path in args.profile:
        profile = _profile(path, engine_options)
        size = profile.tensor_parallel_size
        if size in out:
            raise ValueError(f"--profile: {where[size]} and {path} are both of workers of {size} GPUs; "
                             "give one per size")
        out[size], where[size] = profile, path
    return out


def _profile(path: Path, engine_options: dict[str, Any]) -> Any:
    from cluster.planner import StepProfile

    if path.is_file():
        return StepProfile.model_validate_json(path.read_text())
    from cluster.planner.measure import decode_fits, measure
    from engine.engine import EngineCore
    from engine.llm import engine_config

    options = dict(engine_options)
    engine = EngineCore(engine_config(options.pop("model"), **options, async_scheduling=False))  # measure's need
    longest = min(engine.config.scheduler.max_num_batched_tokens, engine.max_seq_tokens - 1)
    most = engine.config.scheduler.max_num_seqs  # NOTE: the batch a busy worker runs: measured, not extrapolated
    batches = sorted({b for b in DECODE_BATCHES if b < most} | {most})
    contexts = [c for c in DECODE_CONTEXTS if decode_fits(engine, max(batches), c, DECODE_REPEATS)] or [64]
    print(f"measuring a step profile on {engine.device} (written to {path}) ...", flush=True)
    # NOTE: the grid ends at the longest step the engine makes (a chunk of that size is every long prompt's)
    lengths = sorted({n for n in PREFILL_TOKENS if n < longest} | {longest})
    profile = measure(engine, lengths, batches, contexts, repeats=REPEATS, decode_repeats=DECODE_REPEATS,
                      report=lambda line: print(line, flush=True))
    profile = profile.model_copy(update={"tensor_parallel_size": engine.config.parallel.tensor_parallel_size})
    path.write_text(profile.model_dump_json(indent=2) + "\n")  # NOTE: before close, which waits for the ranks
    engine.close()
    return profile


def run(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    from cluster.config import ClusterConfig
    from cluster.planner import SLO, Workload, plan
    from deploy.schema import ServeAppConfig
    from engine.llm import engine_config
    from router.core import RouterConfig

    profiles = _profiles(args, engine_options)
    workload = Workload(prompt_tokens=tuple(args.prompt_tokens), output_tokens=tuple(args.output_tokens),
                        samples=_samples(args.samples), num_requests=args.num_requests)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    plans = plan(args.gpus, profiles, workload, slo)
    print(f"{'layout':<20}{'goodput req/s':>14}  why")
    for p in plans:
        print(f"{p.layout.name:<20}{p.goodput:>14.2f}  {p.why}")
    best = plans[0]
    print(f"best: {best.layout.name}; attainment by rate: "
          + ", ".join(f"{pt.rate:.3g}: {100 * pt.attainment:.1f}%" for pt in best.points))
    if args.out is not None:
        options = dict(engine_options)
        cluster = ClusterConfig(
            engine=engine_config(options.pop("model"), **options),
            mode="colocated" if best.layout.num_prefill == 0 else "disaggregated",
            num_prefill=max(best.layout.num_prefill, 1), num_decode=best.layout.num_decode,
            prefill_tp=best.layout.prefill_tp, decode_tp=best.layout.decode_tp,
        )
        app = ServeAppConfig(cluster=cluster, router=RouterConfig(model_name=engine_options["model"]))
        args.out.write_text(app.model_dump_json(indent=2, exclude_defaults=True) + "\n")
        print(f"wrote {args.out}: pdserve serve --config {args.out}")
    return 0
