"""Speculative decoding: acceptance per drafted token, tokens per target step against the
formula, and decode tokens/s with and without speculation.

Models: --target and --draft (HF checkpoint directories, or 'default' for the embedded model; the
draft follows the target's --load-format and --dtype); --method draft (the default) or ngram.

1. Acceptance, at --temperature (1.0): for each K of --ks, with adaptive K off, --num-requests
   requests run together, each with --max-tokens output tokens (ignore_eos). Prompts are slices of
   --text (held-out text, tokenized with the target's tokenizer) or, without it, random token ids.
   Reported: a = accepted / tested drafted tokens (the first rejection of a step ends its tests),
   accepted / drafted, and tokens per target step per request (emitted / verifications) against
   (1 - a^(K+1)) / (1 - a).
2. Decode speed at batch 1 and --large-batch: plain vs speculative (K = max(--ks), adaptive K, and
   --disable-above-batch-size), same prompts, both engines built side by side (a fixed KV cache
   each) and their runs alternated. Timed from the step after every request has its first token
   (prefill excluded) to the end, device synchronised; decode tokens/s = tokens generated in that
   window / its seconds; the median of --repeats runs (and the best).

Every run ends with the leak check (target and draft pools). On a CPU, or with the target as its
own draft, the numbers only show that the pipeline works (the JSON says so in "notes").

    .venv/bin/python -m bench.spec_decode --target DIR --draft DIR [--text FILE] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    base_parser,
    build_engine,
    check_no_leak,
    decode_window,
    environment,
    free_device_memory,
    label_bars,
    random_prompts,
    synchronize,
    title,
    write_results,
)
from bench.profile_step import phases
from engine import EngineCore, SamplingParams, SpeculativeConfig, Tokenizer
from engine.rank import resolve_model_dir


def predicted_tokens_per_step(a: float, k: int) -> float:
    """Expected tokens a verification yields when each draft is accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def make_prompts(args: argparse.Namespace, num: int, vocab_size: int, seed: int) -> list[list[int]]:
    if args.text is None:
        return random_prompts(num, args.prompt_len, vocab_size, seed)
    tokenizer = Tokenizer.from_dir(resolve_model_dir(args.model))
    ids = tokenizer.encode(Path(args.text).read_text(errors="replace"), add_special_tokens=False)
    if len(ids) < args.prompt_len + 1:
        raise ValueError(f"--text {args.text} has {len(ids)} tokens; --prompt-len is {args.prompt_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - args.prompt_len) for _ in range(num)]
    return [ids[s : s + args.prompt_len] for s in starts]


def _params(args: argparse.Namespace, num: int) -> list[SamplingParams]:
    """Without seeds: sampled requests then verify by rejection sampling, as unseeded traffic does
    (seeded ones compare drafts with the target's own draws and accept a little less often;
    engine/sampler.py). The engine's shared generator is seeded, so a run repeats."""
    return [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)] * num


def draft_of(args: argparse.Namespace) -> str | None:
    """--draft, for the method that reads one (a draft model)."""
    return args.draft if args.method == "draft" else None


def _speculative(args: argparse.Namespace, k: int, adaptive: bool, versus: bool = False) -> SpeculativeConfig:
    """The run's drafter, or with `versus` the one --versus names."""
    method, draft = (args.versus_method, args.versus_draft or None) if versus else (args.method, draft_of(args))
    return SpeculativeConfig(
        method=method,
        draft_model=draft,
        num_draft_tokens=k,
        enable_adaptive_draft_length=adaptive,
        # NOTE: the acceptance runs (not adaptive) draft at every batch size; -1: the speed runs do too
        disable_above_batch_size=args.disable_above_batch_size if adaptive and args.disable_above_batch_size >= 0
        else None,
    )


def _engine(
    args: argparse.Namespace, speculative: SpeculativeConfig | None, max_num_seqs: int, num_blocks: int | None = None
) -> EngineCore:
    free_device_memory()  # NOTE: the previous engine's cache must be gone before this one sizes its own
    if num_blocks is None:
        return build_engine(args, speculative=speculative, max_num_seqs=max_num_seqs)
    return build_engine(args, speculative=speculative, max_num_seqs=max_num_seqs, num_blocks=num_blocks)


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams], tag: str) -> dict[str, Any]:
    """All requests at once; times the decode phase (after every request has its first token)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}-{i}", p, sp)
    gc_s = [0.0]  # the collector's pauses during the run (it runs on this thread, inside the timing)
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    try:
        wall_s, num_tokens, num_steps, _ = decode_window(engine, len(prompts))
    finally:
        gc.callbacks.remove(on_gc)
    check_no_leak(engine)
    return {"decode_s": wall_s, "num_decode_tokens": num_tokens, "num_decode_steps": num_steps, "gc_s": gc_s[0]}


def draft_shape(engine: EngineCore) -> dict[str, Any] | None:
    arch = getattr(engine.proposer, "arch", None)
    if arch is None:
        return None
    return {"num_layers": arch.num_layers, "hidden_size": arch.hidden_size, "num_params": arch.num_params}


def measure_acceptance(args: argparse.Namespace, vocab_size: int, shape: dict[str, Any]) -> list[dict[str, Any]]:
    """Per K: acceptance and tokens per target step. Fills `shape` with the draft model's."""
    prompts = make_prompts(args, args.num_requests, vocab_size, args.seed)
    rows = []
    for k in args.ks:
        engine = _engine(args, _speculative(args, k, adaptive=False), max_num_seqs=max(args.num_requests, 1))
        shape.update(draft_shape(engine) or {})
        _run(engine, prompts, _params(args, len(prompts)), f"acc{k}")
        s = engine.stats()
        tested = s.num_spec_accepted_tokens + s.num_spec_rejections
        a = s.num_spec_accepted_tokens / tested if tested else 0.0
        rows.append(
            {
                "k": k,
                "a_per_tested_draft": a,
                "accepted_per_drafted": s.spec_acceptance_rate,
                "mean_drafted_per_verification": s.num_spec_draft_tokens / max(1, s.num_spec_verifications),
                "tokens_per_target_step": s.num_spec_emitted_tokens / max(1, s.num_spec_verifications),
                "predicted_tokens_per_target_step": predicted_tokens_per_step(a, k),
                "num_verifications": s.num_spec_verifications,
                "num_draft_tokens": s.num_spec_draft_tokens,
                "num_accepted_tokens": s.num_spec_accepted_tokens,
            }
        )
        print(f"K={k}: a={a:.3f} tokens/step {rows[-1]['tokens_per_target_step']:.2f} "
              f"(formula {rows[-1]['predicted_tokens_per_target_step']:.2f})")
        del engine
    return rows


def measure_speed(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    """Per batch size: a plain and a speculative engine side by side (each with a fixed KV cache, so
    both fit), one warm-up run each, then --repeats runs of each, alternating which goes first (the
    host's speed drifts between runs; alternating spreads the drift over both modes)."""
    rows = []
    for batch in (1, args.large_batch):
        ks = sorted(set(args.batch1_ks or [max(args.ks)])) if batch == 1 else [max(args.ks)]
        prompts = make_prompts(args, batch, vocab_size, args.seed + 1)
        per_seq = -(-(args.prompt_len + args.max_tokens + max(ks) + 1) // 16) + 1
        engines: dict[tuple[str, int | None, str | None], EngineCore] = {}
        keys = [("plain", None, None), *(("speculative", k, args.method) for k in ks)]
        if args.versus:
            keys.append(("speculative", max(ks), args.versus_method))
        for mode, k, method in keys:
            spec = _speculative(args, k, adaptive=True, versus=method != args.method) if k is not None else None
            engines[mode, k, method] = _engine(args, spec, max_num_seqs=batch, num_blocks=batch * per_seq + 16)
            _run(engines[mode, k, method], prompts, _params(args, batch), f"warmup-{mode}{k or ''}{method or ''}")
        runs: dict[tuple[str, int | None, str | None], list[dict[str, Any]]] = {key: [] for key in engines}
        order = list(engines)
        # NOTE: the engines' objects are frozen out of the collector's reach, as a serving worker's are
        # (DecodeWorkerConfig.freeze_gc): a full collection over them took tens of ms inside a timed run.
        gc.collect()
        gc.freeze()
        try:
            for r in range(args.repeats):
                for key in (order if r % 2 == 0 else order[::-1]):
                    runs[key].append(_run(engines[key], prompts, _params(args, batch), f"r{r}"))
        finally:
            gc.unfreeze()
        plain_runs = runs["plain", None, None]
        for (mode, k, method), engine in engines.items():
            mine = runs[mode, k, method]
            # Each repeat's plain run over this one (they ran side by side): drift between repeats
            # cancels in the ratio; its median is the paired speedup.
            paired = [p["decode_s"] / x["decode_s"] * x["num_decode_tokens"] / p["num_decode_tokens"]
                      for p, x in zip(plain_runs, mine)]
            run = sorted(mine, key=lambda x: x["decode_s"])[(len(mine) - 1) // 2]
            s = engine.stats()
            rows.append(
                {
                    "batch_size": batch,
                    "mode": mode,
                    "k": k,
                    "method": method,
                    "decode_tokens_per_s": run["num_decode_tokens"] / run["decode_s"],
                    "best_decode_tokens_per_s": max(x["num_decode_tokens"] / x["decode_s"] for x in mine),
                    "decode_s_all": [x["decode_s"] for x in mine],
                    "gc_s_all": [x["gc_s"] for x in mine],
                    "paired_speedup_all": paired,
                    "paired_speedup": statistics.median(paired),
                    **run,
                    "spec_acceptance_rate": s.spec_acceptance_rate,
                    "num_spec_verifications": s.num_spec_verifications,
                    # NOTE: getattr: an A/B runs this bench on a checkout from before the draft gate too
                    "num_spec_gate_overturns": getattr(s, "num_spec_gate_overturns", None),
                }
            )
            print(f"batch {batch} {mode}{'' if method is None else ' ' + method}: "
                  f"{rows[-1]['decode_tokens_per_s']:.1f} decode tokens/s (median; best "
                  f"{rows[-1]['best_decode_tokens_per_s']:.1f}, paired {rows[-1]['paired_speedup']:.2f}x)")
        del engines
    return rows


def profile_steps(args: argparse.Namespace, vocab_size: int, batch: int) -> dict[str, Any]:
    """Where a step's time goes at `batch` requests, plain and speculative: the phases (synchronous
    steps), a host profile (cProfile, own time) and the device launches a step makes (torch.profiler)."""
    import cProfile
    import io
    import pstats

    k = max(args.ks)
    prompts = make_prompts(args, batch, vocab_size, args.seed + 2)
    record: dict[str, Any] = {"batch_size": batch}
    for mode in ("plain", "speculative"):
        spec = _speculative(args, k, adaptive=True) if mode == "speculative" else None
        engine = _engine(args, spec, max_num_seqs=batch, num_blocks=64 * batch)
        engine.async_scheduling = False
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=10_000, temperature=args.temperature,
                                                               ignore_eos=True))
        for _ in range(5):
            engine.step()
        row: dict[str, Any] = {"phases_s": phases(engine, 40)}
        row["host_calls_s"] = _host_call_times(engine, 40)
        profiler = cProfile.Profile()
        profiler.enable()
        steps0 = engine.stats().num_spec_verifications
        for _ in range(40):
            engine.step()
        synchronize(engine.device)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(f"== batch {batch} {mode}: phases", {n: f"{v * 1e3:.3f} ms" for n, v in row["phases_s"].items()})
        calls = {n: {k: round(v * 1e3, 4) if k != "per_step" else v for k, v in c.items()}
                 for n, c in row["host_calls_s"].items()}
        print(f"== batch {batch} {mode}: host calls", calls)
        print(text.getvalue())
        if engine.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(10):
                    engine.step()
                synchronize(engine.device)
            counts: dict[str, int] = {}
            for e in prof.events():
                if e.name in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
                              "cudaEventSynchronize", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaStreamWaitEvent",
                              "cudaEventRecord", "cudaMemsetAsync"):
                    counts[e.name] = counts.get(e.name, 0) + 1
            row["runtime_calls_per_step"] = {n: c / 10 for n, c in counts.items()}
            print(f"== batch {batch} {mode}: runtime calls per step", row["runtime_calls_per_step"])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        row["verifications_in_profile"] = engine.stats().num_spec_verifications - steps0
        record[mode] = row
        for i in range(batch):
            engine.abort_request(f"p{i}")
        while engine.has_unfinished():
            engine.step()
        del engine
    return record


def _host_call_times(engine: EngineCore, num_steps: int) -> dict[str, dict[str, float]]:
    """Host seconds of the calls a step makes that may wait on the device or the driver (a CUDA
    graph's replay, the staging buffer's hand-out and upload), per call: median, max and count per
    step, over num_steps unsynchronised steps."""
    from engine.pinned import HostStaging

    targets = {"graph_replay": (torch.cuda.CUDAGraph, "replay"), "staging_host": (HostStaging, "host"),
               "staging_upload": (HostStaging, "upload")}
    times: dict[str, list[float]] = {name: [] for name in targets}
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def timed(name: str) -> Any:
        original = originals[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - start)

        return call

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, timed(name))
    try:
        for _ in range(num_steps):
            engine.step()
        synchronize(engine.device)
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])
    return {name: {"median_s": statistics.median(t), "max_s": max(t), "per_step": len(t) / num_steps}
            for name, t in times.items() if t}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--target", dest="model", help="Target checkpoint directory (same as --model).")
    parser.add_argument("--draft", default="default", help="Draft checkpoint directory, or 'default'.")
    parser.add_argument("--method", default="draft", choices=["draft", "ngram"])
    parser.add_argument("--versus", default=None, metavar="METHOD[=DIR]",
                        help="Another drafter (draft=DIR, or ngram) whose speed is measured in the same runs, at "
                             "K = max(--ks), alternated with plain and --method.")
    parser.add_argument("--text", type=Path, default=None, help="Held-out text for prompts (else random ids).")
    parser.add_argument("--ks", type=int, nargs="+", default=None, help="Draft lengths K (1 2 4 8; 1 2 4 quick).")
    parser.add_argument("--num-requests", type=int, default=None, help="Acceptance requests (32; 8 quick).")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None, help="Output tokens a request (128; 32 quick).")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--large-batch", type=int, default=None, help="The large batch (128; 8 quick).")
    parser.add_argument(
        "--disable-above-batch-size", type=int,
        default=SpeculativeConfig.model_fields["disable_above_batch_size"].default,
        help="SpeculativeConfig's (default: its default); -1: draft at every batch size.",
    )
    parser.add_argument("--repeats", type=int, default=None, help="Timed runs per speed point (5; 1 quick).")
    parser.add_argument("--batch1-ks", type=int, nargs="+", default=None,
                        help="Draft lengths K whose batch-1 speed is measured side by side (default: largest --ks).")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=None,
                        help="Also profile a step at each of these batch sizes, plain and speculative (steps timed "
                             "synchronously, cProfile, torch.profiler's launches).")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"ks": [1, 2, 4] if quick else [1, 2, 4, 8], "num_requests": 8 if quick else 32,
                "max_tokens": 32 if quick else 128, "large_batch": 8 if quick else 128, "repeats": 1 if quick else 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("num_requests", "prompt_len", "max_tokens", "large_batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.ks) < 1:
        parser.error(f"--ks must all be at least 1, got {args.ks}")
    args.versus_method, _, args.versus_draft = (args.versus or "").partition("=")
    if args.versus is not None and (args.versus_method == args.method or args.versus_method not in ("draft", "ngram")
                                    or bool(args.versus_draft) != (args.versus_method == "draft")):
        parser.error(f"--versus must be draft=DIR or ngram, a method other than --method {args.method}; "
                     f"got {args.versus!r}")
    return args


def notes(args: argparse.Namespace, device: torch.device) -> dict[str, str]:
    """Caveats of this run: a short tag (for the plot's title) -> the full sentence (for the JSON)."""
    out = {}
    draft_dir, target_dir = resolve_model_dir(args.draft).resolve(), resolve_model_dir(args.model).resolve()
    if args.method == "draft" and draft_dir == target_dir:
        out["SMOKE RUN: target = draft"] = (
            "smoke run: the target is its own draft, so every draft is (nearly) accepted by construction; "
            "this shows the pipeline works, not what a real draft gains"
        )
    if device.type != "cuda":
        out["CPU"] = (
            "CPU run: a draft's forward pass costs about as much as the target's at these sizes, so speed-ups "
            "here say nothing about a GPU"
        )
    if args.text is None:
        out["random prompts"] = "prompts are random token ids, not held-out text"
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    probe = _engine(args, None, max_num_seqs=1)
    vocab_size, env = probe.arch.vocab_size, environment(probe, args)
    del probe
    shape: dict[str, Any] = {}
    acceptance = measure_acceptance(args, vocab_size, shape)
    speed = measure_speed(args, vocab_size)
    profile = [profile_steps(args, vocab_size, b) for b in args.profile_batches or []]
    speedups: dict[str, Any] = {}
    for batch in (1, args.large_batch):
        plain = next(r["decode_tokens_per_s"] for r in speed if r["batch_size"] == batch and r["mode"] == "plain")
        mine = [r for r in speed if r["batch_size"] == batch and r["method"] == args.method]
        by_k = {r["k"]: r["decode_tokens_per_s"] / plain for r in mine}
        speedups[str(batch)] = max(by_k.values())  # the best K measured (a deployment's choice)
        speedups[f"{batch}_by_k"] = {str(k): v for k, v in by_k.items()}
        speedups[f"{batch}_paired_by_k"] = {str(r["k"]): r["paired_speedup"] for r in mine}
        versus = [r for r in speed if r["batch_size"] == batch and r["method"] not in (None, args.method)]
        if versus:
            speedups[f"{batch}_paired_versus_{args.versus_method}"] = versus[0]["paired_speedup"]
    workload = {
        "method": args.method, "target": args.model, "draft": draft_of(args), "versus": args.versus,
        "draft_shape": shape or None,
        "ks": args.ks, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "large_batch": args.large_batch,
        "disable_above_batch_size": args.disable_above_batch_size, "repeats": args.repeats,
        "prompts": f"slices of {args.text}" if args.text else f"uniform random token ids, seed {args.seed}",
    }
    caveats = notes(args, torch.device(env["device"]))
    record = {"workload": workload, "notes": list(caveats.values()), "acceptance": acceptance,
              "speed": speed, "speedup": speedups, "profiles": profile}

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        ks = [r["k"] for r in acceptance]
        ax1.plot(ks, [r["tokens_per_target_step"] for r in acceptance], "o-", label="measured")
        predicted = [r["predicted_tokens_per_target_step"] for r in acceptance]
        ax1.plot(ks, predicted, "x--", label="(1 - a^(K+1)) / (1 - a)")
        for r in acceptance:
            ax1.annotate(f"a={r['a_per_tested_draft']:.2f}", (r["k"], r["tokens_per_target_step"]), fontsize=8)
        ax1.set(xlabel="K (drafted tokens per step)", ylabel="tokens per target step, per request",
                title=f"acceptance at temperature {args.temperature}")
        ax1.legend()
        labels = [f"batch {r['batch_size']}\n{r['method'] or r['mode']}" + (f" K={r['k']}" if r["k"] else "")
                  for r in speed]
        values = [r["decode_tokens_per_s"] for r in speed]
        bars = ax2.bar(labels, values, color=["tab:gray" if r["mode"] == "plain" else "tab:blue" for r in speed])
        label_bars(ax2, bars, values, "{:.0f}")
        ax2.set(ylabel="decode tokens/s", title=f"decode speed (speculative: adaptive K, K max = {max(args.ks)})")

    line = f"method {args.method}, draft {workload['draft']}; " + "; ".join(caveats)
    plot_title = title("Speculative decoding", env, line)
    json_path, png_path = write_results(args.out, "spec_decode", env, record, plot, plot_title)
    print(f"wrote {json_path} and {png_path}")
    return {"json": str(json_path), "png": str(png_path), **record}


if __name__ == "__main__":
    main()
