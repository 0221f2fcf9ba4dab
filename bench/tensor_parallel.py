"""Tensor parallelism on one host's GPUs, TP sizes side by side in one run (each size in its own
process, so one's memory never crowds the next):

  (1) decode step time by batch (one context length), consecutive steps timed as one, beside the
      bandwidth floor of a rank: (its weight bytes + its KV bytes read) / measured copy bandwidth;
  (2) the all-reduces of a decode step alone (2 per layer + the embedding's, [batch, hidden] in the
      model dtype, captured in a CUDA graph as the step does), as a share of the step;
  (3) rank 0's hand-off of each step to the other ranks (host time per step);
  (4) optionally, offline throughput: --requests prompts of --isl tokens, --osl output tokens each.

    python -m bench.tensor_parallel --model bench/shapes/llama-3.1-8b --load-format dummy --tp 1 2
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (add_child_arguments, base_parser, device_name, finish_child, graph_seconds, model_label,
                          run_in_processes, synchronize, write_results)
from bench.offline_throughput import copy_bandwidth, decode_step_times, step_weight_bytes
from engine import LLM, SamplingParams
from engine.parallel import PartialSum, TPGroup
from engine.parallel.follower import RankCall


def allreduce_seconds(group: TPGroup, rows: int, hidden: int, count: int, dtype: str) -> tuple[float, str]:
    """Device time of `count` all-reduces of [rows, hidden] as a decode step takes them, captured in one CUDA
    graph (median of 10 replays), and which: where the group leaves them to the norm after them
    (TPGroup.all_reduce_later), each with its residual add and RMSNorm in the one kernel; every rank calls it
    at once."""
    x = torch.zeros(rows, hidden, dtype=getattr(torch, dtype), device=group.device)
    residual, weight = torch.zeros_like(x), torch.ones(hidden, dtype=x.dtype, device=x.device)

    def fused() -> Any:
        return group.add_rms_norm(group.all_reduce_later(x), residual, weight, 1e-5, False)

    if isinstance(group.all_reduce_later(x), PartialSum):  # NOTE: else it was one all-reduce, on every rank alike
        return graph_seconds(fused, group.device, count), "fused with the norm after it"
    return graph_seconds(lambda: group.all_reduce(x), group.device, count), "alone"


def _follower_allreduce(follower: Any, *args: Any) -> None:
    allreduce_seconds(follower.group, *args)


def offline(llm: LLM, requests: int, isl: int, osl: int) -> dict[str, Any]:
    engine, rng = llm.engine, random.Random(3)
    for i in range(requests):
        prompt = [rng.randrange(engine.arch.vocab_size) for _ in range(isl)]
        engine.add_request(f"o{i}", prompt, SamplingParams(max_tokens=osl, ignore_eos=True, temperature=0.6))
    synchronize(engine.device)
    kinds = {"prompt": [0.0, 0, 0, 0], "decode": [0.0, 0, 0, 0]}  # device s, steps, prompt tokens, decode rows
    observe = engine.rates.observe

    def counted(seconds: float, prompt_tokens: int, decode_rows: int) -> None:
        kind = kinds["prompt" if prompt_tokens else "decode"]
        kind[0] += max(seconds, 0.0)
        kind[1] += 1
        kind[2] += prompt_tokens
        kind[3] += decode_rows
        observe(seconds, prompt_tokens, decode_rows)

    engine.rates.observe = counted  # type: ignore[method-assign]
    start, num_out = time.perf_counter(), 0
    try:
        while engine.has_unfinished():
            num_out += sum(len(o.new_token_ids) for o in engine.step())
        synchronize(engine.device)
        engine.step_timer.collect(engine.rates)  # the last steps' times
    finally:
        engine.rates.observe = observe  # type: ignore[method-assign]
    elapsed = time.perf_counter() - start
    steps = {name: {"device_s": s, "steps": n, "prompt_tokens": p, "mean_decode_rows": r / n if n else 0.0}
             for name, (s, n, p, r) in kinds.items()}
    return {"requests": requests, "isl": isl, "osl": osl, "elapsed_s": elapsed, "output_tokens": num_out,
            "output_tok_per_s": num_out / elapsed, "preemptions": engine.stats().num_preemptions,
            # where the time went: steps that computed prompt tokens and steps that only decoded, by the
            # engine's device timing of each step (engine/step_timer.py); the rest of elapsed_s the device idled
            "steps": steps}


def one_size(args: Any, tp: int) -> dict[str, Any]:
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
              max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len)
    engine = llm.engine
    arch, bandwidth = engine.arch, copy_bandwidth(engine.device)
    leader = engine.runner.leader
    handoff = {"seconds": 0.0, "steps": 0}
    if leader is not None:
        inner = leader.hand_off

        def timed_hand_off(*a: Any) -> None:
            t = time.perf_counter()
            inner(*a)
            handoff["seconds"] += time.perf_counter() - t
            handoff["steps"] += 1

        leader.hand_off = timed_hand_off  # type: ignore[method-assign]
    rows = decode_step_times(engine, args.batches, [args.context], None)
    weight_bytes = step_weight_bytes(engine.runner.model)  # rank 0's shards
    for row in rows:
        kv_bytes = engine.block_bytes / engine.pool.block_size * row["num_running"] * row["context"]
        row["floor_s"] = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
        row["floor_ratio"] = row["step_s"] / row["floor_s"] if bandwidth else None
        row["output_tok_per_s"] = row["num_running"] / row["step_s"]
        if leader is not None and engine.device.type == "cuda":
            count = 2 * arch.num_layers + 1
            leader.send(RankCall(_follower_allreduce, (row["num_running"], arch.hidden_size, count, args.dtype_name)))
            row["allreduce_s"], row["allreduce_path"] = allreduce_seconds(
                leader.group, row["num_running"], arch.hidden_size, count, args.dtype_name)
            row["allreduce_share"] = row["allreduce_s"] / row["step_s"]
        print(f"TP={tp} batch {row['batch']}: {row['step_s'] * 1e3:.2f} ms/step"
              + (f", floor {row['floor_s'] * 1e3:.2f} ms (x{row['floor_ratio']:.2f})" if bandwidth else "")
              + (f", all-reduce ({row['allreduce_path']}) {row['allreduce_share']:.0%}" if "allreduce_share" in row
                 else ""), flush=True)
    result: dict[str, Any] = {
        "tp": tp, "device_name": device_name(engine.device),
        "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
        "num_blocks": engine.pool.num_blocks, "decode": rows, "parallel": engine.parallel,
        "handoff_ms_per_step": 1e3 * handoff["seconds"] / handoff["steps"] if handoff["steps"] else None,
    }
    if args.requests:
        result["offline"] = offline(llm, args.requests, args.isl, args.osl)
        print(f"TP={tp} offline: {result['offline']['output_tok_per_s']:.0f} output tok/s", flush=True)
    env = {"device": str(engine.device), "model": {"name": model_label(args.model), "num_params": arch.num_params,
                                                     "num_layers": arch.num_layers, "hidden_size": arch.hidden_size}}
    result["env"] = env
    return result  # NOTE: not closed: the child process exits at once (main) with its figures written


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--isl", type=int, default=1000)
    parser.add_argument("--osl", type=int, default=1000)
    parser.add_argument("--size-timeout-s", type=float, default=300.0, help="Most seconds one size may take.")
    add_child_arguments(parser, int)  # one size, in a child process
    args = parser.parse_args()
    args.dtype_name = "bfloat16" if args.dtype == "auto" else args.dtype
    if args.one is not None:
        finish_child(args.one_out, one_size(args, args.one),
                     cleanup=lambda: [child.kill() for child in multiprocessing.active_children()])  # other ranks
    write(args, run_in_processes("bench.tensor_parallel", args.tp, args.size_timeout_s))


def write(args: Any, runs: list[dict[str, Any]]) -> None:
    base = {r["tp"]: r for r in runs}
    if 1 in base:
        for r in runs:
            for row, ref in zip(r["decode"], base[1]["decode"]):
                row["speedup_vs_tp1"] = ref["step_s"] / row["step_s"]
    env = {**runs[0]["env"], "device_name": runs[0]["device_name"], "num_gpus": torch.cuda.device_count(),
           "torch_version": torch.__version__}
    env["model"].update(dtype=args.dtype_name, load_format=args.load_format)
    for r in runs:
        r.pop("env")
    name = f"tensor_parallel_{Path(args.model).name}"

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        for r in runs:
            xs = [row["batch"] for row in r["decode"]]
            ax.plot(xs, [row["step_s"] * 1e3 for row in r["decode"]], marker="o", label=f"TP={r['tp']} step")
            if r["copy_bandwidth_gbs"]:
                ax.plot(xs, [row["floor_s"] * 1e3 for row in r["decode"]], linestyle="--", label=f"TP={r['tp']} floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (decoding sequences)")
        ax.set_ylabel(f"ms per decode step (context {args.context})")
        ax.legend()

    heading = (f"{name}: {env['model']['name']} {args.dtype_name} {args.load_format}, {env['device_name']} x"
               f"{env['num_gpus']}, torch {env['torch_version']}")
    write_results(Path(args.out), name, env, {"context": args.context, "runs": runs}, plot, heading)


if __name__ == "__main__":
    main()
