"""Skipping the remote prefill: time to first token of prompts computed by their decode worker itself
(`prefill_locally`) against prompts sent through a prefill worker (lease -> prefill -> KV push),
on a local Ray cluster of 1 prefill + 1 decode worker (gloo on a CPU), with the default model.

For each prompt length, fresh random prompts (no prefix-cache hit anywhere), one at a time, the two
paths alternating, each timed as the router sees it: `Dispatcher.generate()` -> first token. Twice:
on an idle cluster, and under a decode load (background streams decoding on the same decode worker),
where the background streams' inter-token gaps while each measured request runs are recorded too:
what a local prefill costs the running batch, against what it saves the new request. The figures
are what DispatcherConfig.local_prefill.max_short_prompt_tokens is chosen from.

    python -m bench.skip_prefill                # about 1 to 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import statistics
import time
from typing import Any

import ray

from bench.common import base_parser, build_engine, environment, title, write_results
from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from engine import SamplingParams
from engine.llm import engine_config
from router import Dispatcher, DispatcherConfig, LocalPrefillConfig

PATHS = {
    "remote": LocalPrefillConfig(rule="remote"),
    "local": LocalPrefillConfig(max_short_prompt_tokens=1 << 20),  # every prompt on the decode worker
}
FIRST_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class Background:
    """`num_streams` greedy streams decoding on the decode worker until stopped (each restarts when
    it reaches max_tokens), every token's arrival time recorded per stream."""

    def __init__(self, dispatcher: Dispatcher, num_streams: int, vocab_size: int, max_tokens: int) -> None:
        self.dispatcher = dispatcher
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.arrivals: list[list[float]] = [[] for _ in range(num_streams)]
        rng = random.Random(1)
        self.prompts = [[rng.randrange(4, vocab_size) for _ in range(16)] for _ in range(num_streams)]
        self.tasks = [asyncio.ensure_future(self._stream(i)) for i in range(num_streams)]
        self.num_restarts = 0

    async def _stream(self, i: int) -> None:
        for run in range(1_000_000):
            self.arrivals[i].append(float("nan"))  # NOTE: no gap across a restart (that is a TTFT)
            async for out in self.dispatcher.generate(f"bg-{i}-{run}", self.prompts[i], self.params):
                if out.new_token_ids:
                    self.arrivals[i].append(time.perf_counter())
            self.num_restarts += 1

    async def running(self) -> None:
        """Returns once every stream has tokens coming."""
        while not all(len(a) >= 3 for a in self.arrivals):
            await asyncio.sleep(0.05)

    def gaps(self, start: float, end: float) -> list[float]:
        """Seconds between consecutive tokens of a stream, for tokens that arrived in [start, end]."""
        out = []
        for times in self.arrivals:
            for before, after in itertools.pairwise(times):
                if start <= after <= end and not math.isnan(before):  # NaN: a restart
                    out.append(after - before)
        return out

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


Samples = dict[int, dict[str, dict[str, list[float]]]]  # length -> path -> "ttft" | "gaps" -> ms


async def sweep(
    dispatchers: dict[str, Dispatcher], lengths: list[int], num_prompts: int, vocab_size: int, tag: str,
    background: Background | None, seed: int,
) -> Samples:
    """Per prompt length and path: TTFT (ms) of `num_prompts` requests (after one warm-up each),
    and, under load, the background streams' inter-token gaps (ms) while they ran."""
    rng = random.Random(seed)
    samples: Samples = {}
    for length in lengths:
        samples[length] = {p: {"ttft": [], "gaps": []} for p in dispatchers}
        for i in range(num_prompts + 1):
            order = list(dispatchers) if i % 2 == 0 else list(reversed(dispatchers))
            for path in order:
                prompt = [rng.randrange(4, vocab_size) for _ in range(length)]
                num_local = dispatchers[path].num_local_prefills
                start = time.perf_counter()
                stream = dispatchers[path].generate(f"{tag}-{path}-{length}-{i}", prompt, FIRST_TOKENS)
                await stream.__anext__()
                first = time.perf_counter()
                async for _ in stream:
                    pass
                end = time.perf_counter()
                assert dispatchers[path].num_local_prefills == num_local + (path == "local"), "took the other path"
                if i == 0:
                    continue  # warm-up: the first request of a length pays for allocator growth
                samples[length][path]["ttft"].append((first - start) * 1e3)
                if background is not None:
                    samples[length][path]["gaps"] += [g * 1e3 for g in background.gaps(start, end)]
        print(tag, length, {p: round(statistics.median(x["ttft"]), 2) for p, x in samples[length].items()}, flush=True)
    return samples


def summarise(samples: Samples, with_gaps: bool) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for length, paths in samples.items():
        row: dict[str, Any] = {}
        for path, x in paths.items():
            row[path] = {
                "ttft_median_ms": round(statistics.median(x["ttft"]), 2),
                "ttft_p90_ms": round(_quantile(x["ttft"], 0.9), 2),
                "num_requests": len(x["ttft"]),
            }
            if with_gaps:
                gaps = x["gaps"]
                row[path]["load_gap_median_ms"] = round(statistics.median(gaps), 2) if gaps else None
                row[path]["load_gap_p90_ms"] = round(_quantile(gaps, 0.9), 2) if gaps else None
                row[path]["load_gap_max_ms"] = round(max(gaps), 2) if gaps else None
                row[path]["num_load_gaps"] = len(gaps)
        row["ttft_saved_median_ms"] = round(row["remote"]["ttft_median_ms"] - row["local"]["ttft_median_ms"], 2)
        rows[str(length)] = row
    return rows


def _pool(runs: list[Samples]) -> Samples:
    pooled: Samples = {}
    for run in runs:
        for length, paths in run.items():
            for path, x in paths.items():
                into = pooled.setdefault(length, {}).setdefault(path, {"ttft": [], "gaps": []})
                into["ttft"] += x["ttft"]
                into["gaps"] += x["gaps"]
    return pooled


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: Any, vocab_size: int) -> dict[str, Any]:
    engine = engine_config(args.model, load_format=args.load_format, device="cpu", seed=args.seed)
    config = ClusterConfig(engine=engine, mode="disaggregated", num_prefill=1, num_decode=1, transport="gloo")
    deployment = Deployment(config)
    started = time.perf_counter()
    await deployment.start()
    startup_s = time.perf_counter() - started
    workers = deployment.workers()
    dispatchers = {
        path: Dispatcher(f"bench-{path}", workers, poll_timeout_s=0.5, config=DispatcherConfig(local_prefill=local))
        for path, local in PATHS.items()
    }
    loader = Dispatcher("bench-load", workers, poll_timeout_s=0.5,
                        config=DispatcherConfig(local_prefill=PATHS["remote"]))
    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        idle_runs = [
            await sweep(dispatchers, lengths, args.num_prompts, vocab_size, f"idle{r}", None, args.seed + 10 * r)
            for r in range(args.repeats)
        ]
        load_average = [round(x, 2) for x in os.getloadavg()]
        background = Background(loader, args.num_streams, vocab_size, args.load_max_tokens)
        await background.running()
        loaded = await sweep(dispatchers, lengths, args.num_loaded_prompts, vocab_size, "loaded", background,
                             args.seed + 1)
        num_restarts = background.num_restarts
        per_repeat = [
            break_even(summarise(run, with_gaps=False), lengths)["longest_prompt_below_overhead"] for run in idle_runs
        ]
        await background.stop()
        for dispatcher in [*dispatchers.values(), loader]:
            await dispatcher.close()
        await asyncio.sleep(1.0)  # the aborted background streams' last polls
        held = await deployment.held_blocks()
    finally:
        deployment.shutdown()
    if any(held.values()):
        raise RuntimeError(f"KV blocks still held after the run: {held}")
    return {
        "cluster": {"num_prefill": 1, "num_decode": 1, "transport": "gloo", "startup_s": round(startup_s, 1)},
        "held_blocks_after": held,
        "load_average_after_idle_sweeps": load_average,  # other work on the machine skews every figure
        "idle": summarise(_pool(idle_runs), with_gaps=False),
        "loaded": summarise(loaded, with_gaps=True),
        "background_restarts": num_restarts,
        "break_even": break_even(summarise(_pool(idle_runs), with_gaps=False), lengths),
        "break_even_per_idle_repeat": per_repeat,
        # what DispatcherConfig.local_prefill.max_short_prompt_tokens is set from
        "longest_prompt_below_overhead_in_every_repeat": min(per_repeat),
    }


def break_even(idle: dict[str, Any], lengths: list[int], num_short: int = 3) -> dict[str, Any]:
    """On the idle cluster: what the remote path costs a request beyond the prefill itself (its
    TTFT minus the local one, median over the `num_short` shortest lengths, where the prompt's
    compute is negligible), against what computing a prompt adds to the decode worker's step (the
    local TTFT over its median at those lengths). Up to the longest length whose added compute
    stays under that overhead, a local prefill delays the decode worker's running batch by less
    than the remote path delays the request itself."""
    short = [str(n) for n in lengths[:num_short]]
    overhead = statistics.median(idle[n]["remote"]["ttft_median_ms"] - idle[n]["local"]["ttft_median_ms"]
                                 for n in short)
    base = statistics.median(idle[n]["local"]["ttft_median_ms"] for n in short)
    added = {str(n): round(idle[str(n)]["local"]["ttft_median_ms"] - base, 2) for n in lengths}
    below = [n for n in lengths if added[str(n)] <= overhead]
    return {
        "remote_overhead_ms": round(overhead, 2),
        "local_prefill_added_ms": added,
        "longest_prompt_below_overhead": max(below),
    }


def plot(fig: Any, record: dict[str, Any]) -> None:
    lengths = [int(x) for x in record["results"]["idle"]]
    ax1, ax2 = fig.subplots(1, 2)
    for scenario, style in (("idle", "-"), ("loaded", "--")):
        rows = record["results"][scenario]
        for path, marker, color in (("remote", "o", "tab:blue"), ("local", "s", "tab:orange")):
            ax1.plot(lengths, [rows[str(n)][path]["ttft_median_ms"] for n in lengths], style, marker=marker,
                     color=color, label=f"{path} prefill, {scenario}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("TTFT ms (median)")
    ax1.legend(fontsize=8)
    rows = record["results"]["loaded"]
    for path, marker, color in (("remote", "o", "tab:blue"), ("local", "s", "tab:orange")):
        ax2.plot(lengths, [rows[str(n)][path]["load_gap_p90_ms"] for n in lengths], marker=marker, color=color,
                 label=f"{path} prefill: p90")
        ax2.plot(lengths, [rows[str(n)][path]["load_gap_max_ms"] for n in lengths], ":", marker=marker, color=color,
                 label=f"{path} prefill: max")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt tokens of the measured request")
    ax2.set_ylabel("background streams' inter-token gap ms")
    ax2.legend(fontsize=8)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8,16,32,64,96,128,192,256,512,1024", help="Prompt lengths (tokens).")
    parser.add_argument("--num-prompts", type=int, default=24, help="Measured requests per length and path, idle.")
    parser.add_argument("--repeats", type=int, default=3, help="Idle sweeps (pooled; break-even also per sweep).")
    parser.add_argument("--num-loaded-prompts", type=int, default=16, help="The same, under the decode load.")
    parser.add_argument("--num-streams", type=int, default=8, help="Background decode streams (the load).")
    parser.add_argument("--load-max-tokens", type=int, default=1024, help="Tokens of one background stream.")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.num_prompts, args.num_loaded_prompts, args.repeats = "8,16,32,256", 3, 3, 1
    args.device = "cpu"
    env_vars = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    os.environ.update(env_vars)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, runtime_env={"env_vars": env_vars})
    local_engine = build_engine(args)  # names the model and the machine in the results; serves nothing
    env = environment(local_engine, args)
    env["ray_version"] = ray.__version__
    try:
        results = asyncio.run(run(args, local_engine.arch.vocab_size))
    finally:
        ray.shutdown()
    workload = {
        "lengths": args.lengths, "num_prompts_per_length_and_path": args.num_prompts, "idle_repeats": args.repeats,
        "num_loaded_prompts_per_length_and_path": args.num_loaded_prompts, "warm_up_per_length": 1,
        "max_tokens": FIRST_TOKENS.max_tokens, "background_streams": args.num_streams,
        "background_max_tokens": args.load_max_tokens, "background_prompt_tokens": 16,
        "ttft": "Dispatcher.generate() to its first output, as the router sees it",
    }
    record = {"workload": workload, "results": results}
    json_path, _ = write_results(
        args.out, "skip_prefill", env, record, lambda fig: plot(fig, record),
        title("Prefill on the decode worker vs through a prefill worker (1P1D, gloo)", env,
              f"fresh prompts, one at a time, {args.repeats}x{args.num_prompts} per length and path idle, "
              f"{args.num_loaded_prompts} "
              f"under {args.num_streams} background decode streams"),
    )
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
