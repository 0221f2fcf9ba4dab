"""Does a host with two GPUs run two offline engines at twice one engine's rate? Issue 29 asks two
colocated workers behind one endpoint for 1.9x one worker's offline rate; served, each worker streamed
about 92% of what one engine alone reached. This separates the host from the token path: the same
offline workload (bench.offline_throughput's nano-vllm one, bench.http_vs_offline's engine settings)
run by one engine alone on GPU 0, then by one engine per GPU at once (a common start on the shared
monotonic clock, once every process is warm), then alone again; each run in its own process, warmed
up on the workload cut short. With --pin, each process of the concurrent run is also bound to one CPU
local to its GPU (sysfs local_cpulist), apart from the others.

    python -m bench.diag.offline_concurrent --model bench/shapes/qwen3-0.6b-vocab2048 --out DIR [--pin]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

READY = "ready"  # a child's line once warm; the parent answers with the common start (perf_counter)


def local_cpus(gpu: int) -> list[int]:
    """The CPUs sysfs names local to GPU `gpu` (nvidia-smi's order); all of this process's if none."""
    bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", str(gpu)],
                         capture_output=True, text=True, check=True).stdout.strip().lower()
    path = Path("/sys/bus/pci/devices") / bus.removeprefix("0000").rjust(12, "0") / "local_cpulist"
    if not path.exists():
        return sorted(os.sched_getaffinity(0))
    cpus: list[int] = []
    for part in path.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def child(args: argparse.Namespace) -> None:
    """One engine on the one GPU this process sees: warm up, wait for the common start, run, print JSON."""
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    from bench.common import build_engine
    from bench.offline_throughput import nano_vllm_workload, run_engine

    opts = argparse.Namespace(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
                              num_threads=None)
    engine = build_engine(opts, max_num_seqs=256, max_num_batched_tokens=16384)
    vocab = engine.arch.vocab_size
    prompts, max_tokens = nano_vllm_workload(256, 0)
    prompts = [[t % vocab for t in p] for p in prompts]
    run_engine(engine, prompts, [min(m, 16) for m in max_tokens])
    print(READY, flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.perf_counter()))
    cpu0 = time.process_time()
    result = run_engine(engine, prompts, max_tokens)
    result["cpu_core_share"] = (time.process_time() - cpu0) / result["elapsed_s"]
    result["affinity"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(result), flush=True)


def run_group(args: argparse.Namespace, gpus: list[int], pin: bool) -> list[dict[str, Any]]:
    """One engine process per GPU in `gpus`, started together; their results in that order."""
    procs = []
    for gpu in gpus:
        cpu = local_cpus(gpu)[2 * gpu + 1] if pin else None  # NOTE: apart from core 0 and from each other
        argv = [sys.executable, "-m", "bench.diag.offline_concurrent", "--child", "--model", args.model,
                *(["--cpu", str(cpu)] if cpu is not None else [])]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:  # NOTE: bounded by the child's output before it warms up
            if line.strip() == READY:
                break
        else:
            raise RuntimeError(f"an engine process ended before warming up (exit {p.wait()})")
    start_at = time.perf_counter() + 0.5
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{start_at}\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"an engine process failed: exit codes {[p.returncode for p in procs]}")
    return [{"gpu": gpu, **json.loads(out.strip().splitlines()[-1])} for gpu, out in zip(gpus, outs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/shapes/qwen3-0.6b-vocab2048")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pin", action="store_true", help="also a concurrent run with each process on its own core")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.out is None:
        parser.error("--out is required (where the results go)")
    import torch

    from bench.common import device_slug

    count = torch.cuda.device_count()
    if count < 2:
        parser.error(f"this needs two GPUs; {count} visible")
    runs: dict[str, list[dict[str, Any]]] = {"alone": run_group(args, [0], False)}
    print("alone", runs["alone"], flush=True)
    runs["both"] = run_group(args, [0, 1], False)
    print("both", runs["both"], flush=True)
    if args.pin:
        runs["both_pinned"] = run_group(args, [0, 1], True)
        print("both_pinned", runs["both_pinned"], flush=True)
    runs["alone_after"] = run_group(args, [0], False)
    print("alone_after", runs["alone_after"], flush=True)
    best_alone = max(runs["alone"][0]["output_tok_per_s"], runs["alone_after"][0]["output_tok_per_s"])
    summary = {name: {"sum_tok_per_s": sum(r["output_tok_per_s"] for r in rs),
                      "over_best_alone": sum(r["output_tok_per_s"] for r in rs) / best_alone}
               for name, rs in runs.items()}
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    record = {"benchmark": "offline_concurrent", "device_name": torch.cuda.get_device_name(0), "model": args.model,
              "num_cpus": os.cpu_count(), "local_cpus": {g: local_cpus(g) for g in range(2)}, "nvidia_smi_topo": topo,
              "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"offline_concurrent_{device_slug(torch.device('cuda'))}.json"
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
