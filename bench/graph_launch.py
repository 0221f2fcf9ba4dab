"""What a CUDA graph replay costs the host, by number of kernels: the floor under a batch-1 step.

1. Synthetic graphs of N tiny kernels (N in --nodes), captured from torch ops (`add_`) and from a
   one-line Triton kernel: the host time of `replay()` alone (device synchronised before each, so
   nothing queued ahead of it) and replay + synchronize, medians of --iters.
2. The engine's own decode graphs (--model, dummy weights): the kernels one eager decode step of one
   row launches (torch.profiler, runtime launch calls counted) and the host time of replaying the
   captured graph of that step alone (the graph of size 1).

    python -m bench.graph_launch --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import triton
import triton.language as tl

from bench.common import base_parser, build_engine, environment, title, write_results
from engine.runner import ForwardSeq

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def replay_times(graph: torch.cuda.CUDAGraph, iters: int, busy_cycles: int = 0) -> tuple[float, float]:
    """Median host seconds of replay() alone, and of replay() + synchronize(). busy_cycles: the
    stream is first given a spin kernel of that many cycles (replay() then queues behind it)."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        graph.replay()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        host.append(launched - start)
        total.append(time.perf_counter() - start)
    return statistics.median(host), statistics.median(total)


def synthetic(nodes: list[int], iters: int) -> list[dict[str, Any]]:
    rows = []
    x = torch.zeros(256, device="cuda")
    for kind in ("torch", "triton"):
        for n in nodes:
            def body() -> None:
                for _ in range(n):
                    if kind == "torch":
                        x.add_(1)
                    else:
                        _add_one[(1,)](x, 256, BLOCK=256)

            body()  # compile / warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            host_s, total_s = replay_times(graph, iters)
            rows.append({"kind": kind, "nodes": n, "replay_host_s": host_s, "replay_sync_s": total_s,
                         "host_us_per_node": host_s / n * 1e6})
            print(rows[-1], flush=True)
    return rows


def engine_graph(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    engine = build_engine(args, max_num_seqs=8)
    runner = engine.runner
    graphs = runner.graphs
    assert graphs is not None, "CUDA graphs are off (enforce_eager?)"
    block_ids = engine.pool.allocate(4)
    seqs = [ForwardSeq([5], 20, block_ids, 1)]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    runner.graphs = None
    runner.forward(seqs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        runner.forward(seqs)
        torch.cuda.synchronize()
    runner.graphs = graphs
    launches = sum(1 for e in prof.events() if e.name in _LAUNCHES)
    runner.forward(seqs)  # the graph of size 1, staged
    host_s, total_s = replay_times(graphs._graphs[1], args.iters)
    # The same with the stream busy (~1 ms of a spin kernel ahead): does replay() wait for it?
    busy_host_s, _ = replay_times(graphs._graphs[1], args.iters, busy_cycles=2_000_000)
    # And the runner's whole graph step (staging, copies, replay, logits) as the engine calls it.
    step = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.forward(seqs)
        step.append(time.perf_counter() - start)
    engine.pool.free(block_ids)
    record = {"eager_kernel_launches": launches, "replay_host_s": host_s, "replay_sync_s": total_s,
              "replay_host_busy_stream_s": busy_host_s, "runner_forward_host_s": statistics.median(step),
              "host_us_per_kernel": host_s / max(1, launches) * 1e6, "num_layers": engine.arch.num_layers}
    return record, environment(engine, args)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="16,64,256")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.graph_launch needs a CUDA device")
    engine_record, env = engine_graph(args)
    record = {"synthetic": synthetic([int(n) for n in args.nodes.split(",")], args.iters), "engine": engine_record}
    print("engine", engine_record, flush=True)

    def plot(fig: Any) -> None:
        ax = fig.subplots()
        for kind in ("torch", "triton"):
            pts = [r for r in record["synthetic"] if r["kind"] == kind]
            ax.plot([r["nodes"] for r in pts], [r["replay_host_s"] * 1e6 for r in pts], "o-", label=f"{kind} kernels")
        e = record["engine"]
        ax.plot([e["eager_kernel_launches"]], [e["replay_host_s"] * 1e6], "r*", markersize=12,
                label=f"engine decode graph, 1 row ({e['num_layers']} layers)")
        ax.set(xlabel="kernels in the graph", ylabel="host us per replay() (median)")
        ax.legend()

    write_results(args.out, "graph_launch", env, record, plot, title("CUDA graph replay: host cost", env, ""))


if __name__ == "__main__":
    main()
