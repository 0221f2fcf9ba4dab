"""Asynchronous against synchronous scheduling on one engine: the nano-vllm workload (as
`bench.offline_throughput`) run several times, the mode alternating, so machine drift shows in
both; then batch-1 decode, the period of consecutive steps in each mode.

    python -m bench.async_vs_sync --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from bench.common import base_parser, build_engine, environment, synchronize, write_results
from bench.offline_throughput import nano_vllm_workload, run_engine
from engine import EngineCore, SamplingParams


def batch1_period(engine: EngineCore, context: int, num_steps: int, seed: int) -> float:
    """Seconds per step of one decoding request, over num_steps consecutive steps."""
    rng = random.Random(seed)
    engine.add_request("b1", [rng.randrange(engine.arch.vocab_size) for _ in range(context)],
                       SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.6))
    for _ in range(20):
        engine.step()  # prefill, then steady decoding
    synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    synchronize(engine.device)
    period = (time.perf_counter() - start) / num_steps
    engine.abort_request("b1")
    while engine.has_unfinished():
        engine.step()
    return period


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of the workload in each mode")
    parser.add_argument("--b1-steps", type=int, default=300)
    args = parser.parse_args()
    engine = build_engine(args, max_num_seqs=256, max_num_batched_tokens=16384)
    if not engine.async_scheduling:
        raise SystemExit("asynchronous scheduling is off on this device (it is on by default on CUDA only)")
    prompts, max_tokens = nano_vllm_workload(256, args.seed)
    vocab = engine.arch.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    if args.quick:
        prompts, max_tokens = [p[:20] for p in prompts[:8]], [min(m, 16) for m in max_tokens[:8]]
    run_engine(engine, [p[:64] for p in prompts[:8]], [8] * 8)  # warm-up
    runs: list[dict[str, Any]] = []
    # NOTE: the mode is switched between runs, with no request live; the engine is the same.
    for i in range(2 * args.repeats):
        engine.async_scheduling = i % 2 == 0
        result = run_engine(engine, prompts, max_tokens)
        runs.append({"async_scheduling": engine.async_scheduling, **result})
        print(f"async={engine.async_scheduling}: {result['output_tok_per_s']:.0f} tok/s", flush=True)
    batch1 = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        batch1["async" if mode else "sync"] = batch1_period(engine, 512, args.b1_steps, args.seed)
        print(f"batch 1, context 512, async={mode}: {batch1['async' if mode else 'sync'] * 1e3:.3f} ms/step",
              flush=True)
    engine.async_scheduling = True
    summary = {
        mode: statistics.median(r["output_tok_per_s"] for r in runs if r["async_scheduling"] == (mode == "async"))
        for mode in ("async", "sync")
    }
    lengths = [len(p) for p in prompts]
    workload = (f"nano-vllm's: {len(prompts)} sequences, prompts {min(lengths)}-{max(lengths)} tokens, "
                f"{sum(max_tokens)} output tokens in all, T=0.6, ignore EOS")
    record = {"workload": workload, "runs": runs,
              "median_output_tok_per_s": summary, "batch1_context512_step_s": batch1}

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        for mode, color in (("async", "tab:blue"), ("sync", "tab:orange")):
            xs = [i for i, r in enumerate(runs) if r["async_scheduling"] == (mode == "async")]
            ax1.bar(xs, [runs[i]["output_tok_per_s"] for i in xs], color=color, label=mode)
        ax1.set_xlabel("run (in order)")
        ax1.set_ylabel("output tokens / s")
        ax1.legend()
        ax2.bar(["async", "sync"], [batch1["async"] * 1e3, batch1["sync"] * 1e3], color=["tab:blue", "tab:orange"])
        ax2.set_ylabel("ms per step, batch 1, context 512")

    env = environment(engine, args)
    write_results(args.out, "async_vs_sync", env, record, plot, "Asynchronous vs synchronous scheduling")


if __name__ == "__main__":
    main()
