"""Where an engine step's time goes: decode-only steps at a few batch sizes, each split into its
phases (schedule, runner, sampler, post-process; CUDA synchronised at each boundary, so the phases
add up to the step), then one cProfile of the whole step (host functions by own time) and one
torch.profiler table (device kernels by time).

    python -m bench.profile_step --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16
    python -m bench.profile_step --replot bench/results/profile_step_....json   # its PNG again, beside it
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from bench.common import base_parser, build_engine, environment, save_plot, synchronize, write_results
from engine import EngineCore, SamplingParams


def fill(engine: EngineCore, batch: int, context: int, temperature: float, rng: random.Random) -> None:
    vocab = engine.arch.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                                     temperature=temperature))
    while engine.stats().num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in engine.scheduler.running):
        engine.step()


def phases(engine: EngineCore, num_steps: int) -> dict[str, float]:
    """Median seconds of each phase of a synchronous step: drafting (speculative decoding; nothing
    without a proposer), schedule, runner, sampler (or verification), post-process."""
    parts: dict[str, list[float]] = {"draft": [], "schedule": [], "runner": [], "sampler": [], "post": [], "step": []}
    sync = lambda: synchronize(engine.device)
    for _ in range(num_steps):
        if not engine.has_unfinished():
            break
        sync()
        start = time.perf_counter()
        engine._draft()
        sync()
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        logits = engine.runner.execute(out.scheduled)
        sync()
        t2 = time.perf_counter()
        sampled = engine._sample(out, logits)
        sync()
        t3 = time.perf_counter()
        engine._post_process(out, sampled)
        t4 = time.perf_counter()
        for name, value in zip(parts, (t0 - start, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - start)):
            parts[name].append(value)
    return {name: statistics.median(values) for name, values in parts.items() if values}


def host_profile(engine: EngineCore, num_steps: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        engine.step()
    synchronize(engine.device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def device_profile(engine: EngineCore, num_steps: int, top: int) -> tuple[str, list[dict[str, Any]]]:
    """torch.profiler's table by device time, and the device activities' rows: each kernel's launches
    and microseconds a step (kernels inside CUDA graph replays included)."""
    if engine.device.type != "cuda":
        return "", []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_steps):
            engine.step()
        synchronize(engine.device)
    averages = prof.key_averages()
    # NOTE: device activities only (kernels, copies): a CPU op's row repeats its kernels' time
    rows = [{"name": e.key, "launches_a_step": e.count / num_steps, "us_a_step": e.self_device_time_total / num_steps}
            for e in averages if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r["us_a_step"])
    return averages.table(sort_by="self_cuda_time_total", row_limit=top), rows


def num_prompt_requests(args: Any) -> int:
    """Prompts --prompt-steps timed and as many profiled steps take, one step before them included."""
    return -(-args.prompt_tokens * (2 * args.prompt_steps + 1) // args.prompt_len) if args.prompt_tokens else 0


def prompt_steps(engine: EngineCore, args: Any, rng: random.Random) -> dict[str, Any]:
    """Steps that compute prompt tokens beside the running batch's decoding (the offline run's other kind):
    prompts of --prompt-len queued for steps of --prompt-tokens each; --prompt-steps of them timed, as many
    profiled (CUDA); their device kernels (as device_profile) and wall time, synchronised, each step's prompt
    tokens and decoding rows."""
    vocab = engine.arch.vocab_size
    counted = {"prompt": 0, "rows": 0, "steps": 0}
    schedule = engine.scheduler.schedule

    def counting(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        counted["prompt"] += out.num_prompt_tokens
        counted["rows"] += out.num_decode_rows
        counted["steps"] += 1
        return out

    for i in range(num_prompt_requests(args)):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        engine.add_request(f"p{i}-{rng.random()}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                                          temperature=args.temperature))
    engine.step()  # the first such step: compiles and plans whatever the mixed shapes need
    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        for _ in range(args.prompt_steps):
            engine.step()
        synchronize(engine.device)
        step_s = (time.perf_counter() - start) / args.prompt_steps
        counts = dict(counted)
        _, kernels = device_profile(engine, args.prompt_steps, 0)
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    steps = max(counts["steps"], 1)
    return {"prompt_tokens_a_step": counts["prompt"] / steps, "decode_rows_a_step": counts["rows"] / steps,
            "step_s": step_s, "kernels_us_a_step": sum(r["us_a_step"] for r in kernels), "device_kernels": kernels}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table; 0 skips the profiles")
    parser.add_argument("--no-fused-ops", action="store_true", help="PyTorch's unfused elementwise ops")
    parser.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (the profiles are rank 0's)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="also profile steps computing this many prompt tokens beside each batch's decoding "
                             "(prompts of --prompt-len; the step's token budget is --max-num-batched-tokens)")
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--prompt-steps", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--replot", type=Path, help="only draw the PNG of this profile_step JSON again, and exit")
    args = parser.parse_args()
    if args.replot:
        print(f"wrote {replot(args.replot)}")
        return
    # NOTE: synchronous steps: the phases are the synchronous step's, run one by one (with
    # asynchronous scheduling they overlap, and a step's inputs may still be on the device).
    batches = [int(b) for b in args.batches.split(",")]
    engine = build_engine(args, max_num_seqs=max(256, max(batches) + num_prompt_requests(args)),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          attention_backend=args.attention_backend, fused_ops=not args.no_fused_ops,
                          async_scheduling=False, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                          tensor_parallel_size=args.tp)
    rng = random.Random(args.seed)
    record: dict[str, Any] = {"context": args.context, "temperature": args.temperature, "batches": []}
    for batch in batches:
        fill(engine, batch, args.context, args.temperature, rng)
        for _ in range(3):
            engine.step()  # warm-up
        row = {"batch": batch, **phases(engine, args.steps)}
        print("phases", {k: f"{v * 1e3:.3f} ms" if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if args.top:
            print(host_profile(engine, args.steps, args.top), flush=True)
            table, row["device_kernels"] = device_profile(engine, 5, args.top)
            print(table, flush=True)
            print(f"device kernels: {sum(r['us_a_step'] for r in row['device_kernels']):.1f} us a step in "
                  f"{sum(r['launches_a_step'] for r in row['device_kernels']):.0f} launches", flush=True)
        if args.prompt_tokens:
            row["prompt_steps"] = prompt_steps(engine, args, rng)
            p = row["prompt_steps"]
            print(f"steps with {p['prompt_tokens_a_step']:.0f} prompt tokens and {p['decode_rows_a_step']:.0f} "
                  f"decoding rows: {p['step_s'] * 1e3:.1f} ms each; kernels {p['kernels_us_a_step'] / 1e3:.1f} ms",
                  flush=True)
        record["batches"].append(row)
        for r in list(engine.scheduler.running):
            engine.abort_request(r.request_id)
        while engine.has_unfinished():
            engine.step()
    env = environment(engine, args)
    write_results(args.out, "profile_step", env, record, lambda fig: plot_phases(fig, record),
                  f"Decode step phases, context {args.context}")


def plot_phases(fig: Any, record: dict[str, Any]) -> None:
    """Each batch's synchronous step by phase, stacked; beside it, where profiled, the last batch's device
    kernels by time a step (the 12 longest)."""
    kernels = record["batches"][-1].get("device_kernels") if record["batches"] else None
    ax, *rest = fig.subplots(1, 2 if kernels else 1, squeeze=False)[0]
    labels = [str(r["batch"]) for r in record["batches"]]
    bottom = [0.0] * len(labels)
    for name in ("schedule", "runner", "sampler", "post"):
        values = [r[name] * 1e3 for r in record["batches"]]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("decode batch")
    ax.set_ylabel("ms per step (synchronous phases)")
    ax.legend()
    if kernels:
        top = sorted(kernels, key=lambda k: k["us_a_step"], reverse=True)[:12][::-1]
        rest[0].barh([k["name"][:48] for k in top], [k["us_a_step"] for k in top])
        rest[0].set_xlabel(f"us a step (batch {record['batches'][-1]['batch']}; "
                           f"{sum(k['us_a_step'] for k in kernels):.0f} in all)")
        rest[0].tick_params(axis="y", labelsize=7)


def replot(path: Path) -> Path:
    """The PNG of a profile_step JSON again, beside it (where the GPU machine had no matplotlib)."""
    record = json.loads(path.read_text())
    png = path.with_suffix(".png")
    env = record["environment"]
    save_plot(png, lambda fig: plot_phases(fig, record),
              f"Decode step phases, context {record['context']}: {env['device_name']}, {env['model']['name']}")
    return png


if __name__ == "__main__":
    main()
