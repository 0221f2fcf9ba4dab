"""Which CUDA graph launch costs a batch-1 speculative step its host time: `bench.spec_decode
--profile` saw two replays a step at 111 us median (max 273) against the plain step's one at 17.
On the trained pair's shapes (bench.train_models --size gpu; dummy weights, greedy, context 256):

1. In steps: the host time of every CUDAGraph.replay during --steps speculative steps, by graph.
2. A cProfile of --steps more speculative steps: where the host's time goes (own and cumulative).
3. Alone: each graph replayed with the device idle before it (synchronised), so nothing queued
   ahead can hold the launch; and the runtime calls its captured body makes when run eagerly
   (torch.profiler), its graph's node count give or take.
4. The device's busy time a step (torch.profiler's kernels and copies, graphs' included) beside the
   step's wall time: which of the host and the device bounds a step.

With --pdl-rows N every kernel launches with programmatic dependent launch up to N rows (engine/pdl.py's
PDL_ANY_MAX_ROWS, 1 in the product), and N = 0 compiles none with it: does the 8-row graph launch slowly because
it mixes PDL and plain launches, as the 1-row graph (all PDL) does not? (bench.diag.graph_launch_pdl's synthetic
graphs of tiny kernels launched in 3 us whatever the mix.)

    python -m bench.diag.spec_graph_launch --load-format dummy --dtype bfloat16 [--pdl-rows N]
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from bench.common import base_parser, build_engine, random_prompts, synchronize
from bench.graph_launch import replay_times
from bench.sampling_step import pair_shape_dir
from engine import SamplingParams, SpeculativeConfig

CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
         "cudaMemsetAsync")


def body_calls(body: Any, size: int) -> dict[str, int]:
    """Runtime calls of one eager run of a graph's captured body."""
    synchronize(torch.device("cuda"))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        body(size)
        torch.cuda.synchronize()
    counts: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.name in CALLS:
            counts[e.name] += 1
    return dict(counts)


def alone(graph: torch.cuda.CUDAGraph, iters: int) -> dict[str, float]:
    """Host microseconds of a replay on an idle device, and of a replay + synchronize (medians)."""
    host_s, total_s = replay_times(graph, iters)
    return {"replay_host_us": host_s * 1e6, "replay_sync_us": total_s * 1e6}


def device_time_per_step(engine: Any, steps: int) -> float:
    """The device's busy time a step (torch.profiler: every kernel and copy, those replayed in graphs
    included), in microseconds: against the step's wall time it says whether the host or the device
    bounds a step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.device_time)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:30]
    print("device time a step by kernel (us, count a step):", flush=True)
    for name, durations in top:
        print(f"  {sum(durations) / steps:8.1f} {len(durations) / steps:6.1f}  {name[:110]}", flush=True)
    return sum(e.device_time for e in kernels) / steps


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=1, help="Requests decoding at once.")
    parser.add_argument("--pdl-rows", type=int, default=None, help="PDL for any kernel up to this many rows (0: none)")
    args = parser.parse_args()
    if args.pdl_rows is not None:
        import engine.pdl

        if args.pdl_rows == 0:
            engine.pdl._capable = lambda index: False  # type: ignore[assignment]  # NOTE: pdl() reads it per call
        else:
            engine.pdl.pdl_options.__defaults__ = (args.pdl_rows,)  # NOTE: max_rows's default, bound at definition
    args.model = pair_shape_dir()
    spec = SpeculativeConfig(method="draft", draft_model=pair_shape_dir("draft"), num_draft_tokens=4)
    engine = build_engine(args, speculative=spec, max_num_seqs=max(4, args.batch))
    proposer = engine.proposer
    named: dict[int, str] = {}
    for size, g in engine.runner.graphs._graphs.items():
        named[id(g)] = f"target_decode_{size}"
    for size, g in proposer.runner.graphs._graphs.items():
        named[id(g)] = f"draft_decode_{size}"
    for size, g in proposer.loop._graphs.items():
        named[id(g)] = f"draft_loop_{size}"
    times: dict[str, list[float]] = defaultdict(list)
    original = torch.cuda.CUDAGraph.replay

    def timed(self: torch.cuda.CUDAGraph) -> None:
        start = time.perf_counter()
        original(self)
        times[named.get(id(self), "other")].append(time.perf_counter() - start)

    params = SamplingParams(max_tokens=args.steps * 20 + 100, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch, 256, engine.arch.vocab_size, 1)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(10):
        engine.step()
    synchronize(engine.device)
    torch.cuda.CUDAGraph.replay = timed  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        synchronize(engine.device)
        step_us = (time.perf_counter() - start) / args.steps * 1e6
    finally:
        torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]
    device_us = device_time_per_step(engine, args.steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    synchronize(engine.device)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    print(text.getvalue(), flush=True)
    in_steps = {name: {"median_us": statistics.median(t) * 1e6, "max_us": max(t) * 1e6, "count": len(t)}
                for name, t in times.items()}
    for i in range(args.batch):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished():
        engine.step()
    target_graphs = engine.runner.graphs._graphs
    verify_size = min(size for size in target_graphs if size >= 5)
    graphs = {"target_decode_1": (target_graphs[1], engine.runner.graphs._body, 1),
              f"target_decode_{verify_size}": (target_graphs[verify_size], engine.runner.graphs._body, verify_size),
              "draft_loop_1": (proposer.loop._graphs[1], proposer.loop._body, 1)}
    print(json.dumps({"step_us": step_us, "device_us_per_step": device_us, "in_steps": in_steps}, indent=1),
          flush=True)
    alone_rows = {}
    for name, (graph, body, size) in graphs.items():
        try:
            alone_rows[name] = {**alone(graph, 50), "eager_body_calls": body_calls(body, size)}
        except Exception as e:  # NOTE: a diagnostic: report what failed and go on to the next graph
            alone_rows[name] = {"error": repr(e)}
        print(name, alone_rows[name], flush=True)
    record = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "pdl_rows": args.pdl_rows,
              "step_us": step_us, "device_us_per_step": device_us,
              "in_steps": in_steps, "alone": alone_rows, "verifications": engine.stats().num_spec_verifications}
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
