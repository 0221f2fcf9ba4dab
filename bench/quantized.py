"""Quantized weights against bfloat16 at one model shape, side by side in one run (each variant in
its own process, so one's memory never crowds the next):

  (1) decode step time by batch (one context length), consecutive steps timed as one, beside the
      bandwidth floor: (the weight bytes a step reads + its KV bytes) / measured copy bandwidth.
      A step reads every weight but the embedding table (only the batch's rows of it);
  (2) offline throughput: --requests prompts of --isl random tokens, --osl output tokens each
      (temperature 0.6, ignore EOS), all submitted at once; output tokens per second;
  (3) the KV cache's capacity in tokens (what the weights leave of the memory budget).

TensorRT-LLM's published FP8 figures for Llama-3.1-8B at ISL 1000 / OSL 1000 (17.7k output tok/s
on an H200, 15.2k on an H100) are written beside (2) as the goal, not measured here.

    python -m bench.quantized --model bench/shapes/llama-3.1-8b --load-format dummy --variants bfloat16 fp8 w4a16
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.common import (
    add_child_arguments, base_parser, device_name, finish_child, model_label, run_in_processes, write_results,
)
from bench.offline_throughput import copy_bandwidth, decode_step_times, step_weight_bytes
from bench.tensor_parallel import offline
from engine import LLM

TRT_LLM_FP8_8B_1000_1000 = {"NVIDIA H200": 17_700, "NVIDIA H100 80GB HBM3": 15_200}
VARIANTS = {"bfloat16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"kv_cache_dtype": "fp8"},
            "fp8+fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}, "w4a16": {}}
"""w4a16: --awq-model (a 4-bit AutoAWQ checkpoint or shape) instead of --model."""


def one_variant(args: Any, variant: str) -> dict[str, Any]:
    model = args.awq_model if variant == "w4a16" else args.model
    llm = LLM(model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_num_seqs=max(args.batches + [args.max_num_seqs]), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, **VARIANTS[variant])
    engine = llm.engine
    bandwidth = copy_bandwidth(engine.device)
    weight_bytes = step_weight_bytes(engine.runner.model)
    rows = decode_step_times(engine, args.batches, [args.context], None)
    for row in rows:
        kv_bytes = engine.block_bytes / engine.pool.block_size * row["num_running"] * row["context"]
        row["floor_s"] = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
        row["floor_ratio"] = row["step_s"] / row["floor_s"] if bandwidth else None
        print(f"{variant} batch {row['batch']}: {row['step_s'] * 1e3:.3f} ms/step"
              + (f", floor {row['floor_s'] * 1e3:.3f} ms (x{row['floor_ratio']:.2f})" if bandwidth else ""), flush=True)
    result: dict[str, Any] = {
        "variant": variant, "weights": engine.weights, "device_name": device_name(engine.device),
        "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None, "step_weight_bytes": weight_bytes,
        "kv_capacity_tokens": engine.capacity_tokens, "num_blocks": engine.pool.num_blocks, "decode": rows,
    }
    if args.requests:
        result["offline"] = offline(llm, args.requests, args.isl, args.osl)
        o = result["offline"]
        steps = ", ".join(f"{k} steps {v['steps']} {v['device_s']:.1f} s (rows {v['mean_decode_rows']:.0f})"
                          for k, v in o["steps"].items())
        print(f"{variant} offline: {o['output_tok_per_s']:.0f} output tok/s in {o['elapsed_s']:.1f} s; {steps}",
              flush=True)
    result["env"] = {"device": str(engine.device), "model": {"name": model_label(args.model),
                                                             "num_params": engine.arch.num_params}}
    return result


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--awq-model", default="bench/shapes/llama-3.1-8b-awq", help="the w4a16 variant's model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--isl", type=int, default=1000)
    parser.add_argument("--osl", type=int, default=1000)
    parser.add_argument("--variant-timeout-s", type=float, default=400.0, help="Most seconds one variant may take.")
    add_child_arguments(parser)  # one variant, in a child process
    args = parser.parse_args()
    if args.one is not None:
        finish_child(args.one_out, one_variant(args, args.one))
    write(args, run_in_processes("bench.quantized", args.variants, args.variant_timeout_s))


def write(args: Any, runs: list[dict[str, Any]]) -> None:
    base = next((r for r in runs if r["variant"] == "bfloat16"), None)
    for r in runs:
        if base is not None:
            for row, ref in zip(r["decode"], base["decode"]):
                row["speedup_vs_bfloat16"] = ref["step_s"] / row["step_s"]
            if "offline" in r:
                tok_per_s = r["offline"]["output_tok_per_s"]
                r["offline"]["speedup_vs_bfloat16"] = tok_per_s / base["offline"]["output_tok_per_s"]
            r["kv_capacity_vs_bfloat16"] = r["kv_capacity_tokens"] / base["kv_capacity_tokens"]
    env = {**runs[0]["env"], "device_name": runs[0]["device_name"], "torch_version": torch.__version__}
    env["model"].update(dtype=args.dtype, load_format=args.load_format)
    for r in runs:
        r.pop("env")
    # NOTE: a published figure, not measured here: only beside the run it describes (8B, ISL/OSL 1000/1000)
    same_point = "llama-3.1-8b" in Path(args.model).name and (args.isl, args.osl) == (1000, 1000)
    goal = TRT_LLM_FP8_8B_1000_1000.get(env["device_name"]) if same_point and args.requests else None
    name = f"quantized_{Path(args.model).name}"

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 2, 1)
        for r in runs:
            xs = [row["batch"] for row in r["decode"]]
            ax.plot(xs, [row["step_s"] * 1e3 for row in r["decode"]], marker="o", label=f"{r['variant']} step")
            if r["copy_bandwidth_gbs"]:
                ax.plot(xs, [row["floor_s"] * 1e3 for row in r["decode"]], linestyle="--",
                        label=f"{r['variant']} floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (decoding sequences)")
        ax.set_ylabel(f"ms per decode step (context {args.context})")
        ax.legend()
        ax = fig.add_subplot(1, 2, 2)
        names = [r["variant"] for r in runs if "offline" in r]
        ax.bar(names, [r["offline"]["output_tok_per_s"] for r in runs if "offline" in r])
        if goal is not None:
            ax.axhline(goal, color="red", linestyle="--", label="TensorRT-LLM FP8, published")
            ax.legend()
        ax.set_ylabel(f"output tok/s, ISL {args.isl} / OSL {args.osl}, {args.requests} requests")

    heading = (f"{name}: {env['model']['name']} {args.load_format}, {env['device_name']}, torch {env['torch_version']}")
    reference = None if goal is None else {
        "not_measured": "TensorRT-LLM's published FP8 offline throughput on this GPU", "tok_per_s": goal,
        "workload": "Llama-3.1-8B FP8, ISL 1000 / OSL 1000"}
    write_results(Path(args.out), name, env, {"context": args.context, "runs": runs,
                                              "published_reference": reference}, plot, heading)


if __name__ == "__main__":
    main()
