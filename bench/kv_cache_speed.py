"""Time per generated token with the KV cache vs recomputing the whole context, at 256 tokens.

One engine with prefix caching off, one request at a time, greedy, `ignore_eos=True`:

- cached: one request with a 256-token random prompt and `max_tokens = 33`. Its first step is
  the prefill (it samples output token 1); each of the next 32 steps is one decode step that
  computes one token over the cached KV of the 256 + j tokens before it (j = 1..32). Measured: the
  time of each `engine.step()`; reported: the median over the decode steps (prefill excluded).
- recompute: for j = 1..32, a fresh request whose prompt is that same context (the 256 prompt
  tokens and the first j tokens the cached run produced) with `max_tokens = 1`. With prefix
  caching off, all 256 + j tokens are computed again to yield the one next token. Measured: the
  time from `add_request` until the request has finished; reported: the median.

Both are timed with `time.perf_counter` (CUDA synchronised at both ends) after one warm-up of
each kind. The ratio is recompute / cached: how many times faster a token is with the cache.
As a check, the count of recomputed tokens equal to the cached run's next token is reported
(all of them in float32; reduced precision may differ in a few).

    .venv/bin/python -m bench.kv_cache_speed [--quick] [--model DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from bench.common import base_parser, build_engine, check_no_leak, environment, label_bars, random_prompts, timed
from bench.common import title, write_results
from engine import EngineCore, SamplingParams, StepOutput


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def _drain(engine: EngineCore) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


def run_cached(engine: EngineCore, prompt: list[int], num_decode: int) -> tuple[list[float], list[int]]:
    """Per-step seconds (step 0 is the prefill) and the output tokens of one request."""
    engine.add_request("cached", prompt, _params(num_decode + 1))
    step_s: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        seconds, outputs = timed(engine.device, engine.step)
        step_s.append(seconds)
        tokens.extend(t for out in outputs for t in out.new_token_ids)
    return step_s, tokens


def run_recompute(engine: EngineCore, prompt: list[int], tokens: list[int], num_decode: int) -> tuple[list[float], int]:
    """Seconds per token when context j (prompt + tokens[:j]) is computed afresh; matches with the cached run."""
    token_s: list[float] = []
    num_matching = 0
    for j in range(1, num_decode + 1):

        def one() -> list[StepOutput]:
            engine.add_request(f"recompute-{j}", prompt + tokens[:j], _params(1))  # noqa: B023
            return _drain(engine)

        seconds, outputs = timed(engine.device, one)
        token_s.append(seconds)
        num_matching += outputs[-1].new_token_ids == [tokens[j]]
    return token_s, num_matching


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--context-len", type=int, default=256, help="Prompt length in tokens.")
    parser.add_argument("--num-decode", type=int, default=None, help="Decode steps timed (32; 8 with --quick).")
    args = parser.parse_args(argv)
    if args.num_decode is None:
        args.num_decode = 8 if args.quick else 32
    for name in ("context_len", "num_decode"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # NOTE: synchronous steps: this bench counts steps, and asynchronous scheduling reports a step's
    # tokens one call later (one more call to drain).
    engine = build_engine(args, enable_prefix_caching=False, async_scheduling=False)
    longest = args.context_len + args.num_decode + 1
    if longest > engine.max_seq_tokens:
        raise ValueError(
            f"--context-len {args.context_len} + --num-decode {args.num_decode} + 1 = {longest} tokens exceeds "
            f"the engine's longest sequence, {engine.max_seq_tokens}: lower them"
        )
    prompt = random_prompts(1, args.context_len, engine.arch.vocab_size, args.seed)[0]
    warm_prompt = random_prompts(1, args.context_len, engine.arch.vocab_size, args.seed + 1)[0]
    _, warm_tokens = run_cached(engine, warm_prompt, min(4, args.num_decode))
    run_recompute(engine, warm_prompt, warm_tokens, 1)
    check_no_leak(engine)

    step_s, tokens = run_cached(engine, prompt, args.num_decode)
    check_no_leak(engine)
    prefill_s, decode_s = step_s[0], step_s[1:]
    recompute_s, num_matching = run_recompute(engine, prompt, tokens, args.num_decode)
    check_no_leak(engine)

    num_preemptions = engine.stats().num_preemptions  # 0 unless the KV cache cannot hold one context
    cached_median, recompute_median = statistics.median(decode_s), statistics.median(recompute_s)
    context_lens = [args.context_len + j for j in range(1, args.num_decode + 1)]
    record = {
        "workload": {
            "context_len": args.context_len,
            "num_decode_steps": args.num_decode,
            "context_lens": context_lens,
            "cached": f"one request, {args.context_len}-token prompt, max_tokens={args.num_decode + 1}; "
            "each engine.step() timed; median over the decode steps (prefill step excluded)",
            "recompute": "per context length, a fresh request with the whole context as prompt and max_tokens=1; "
            "add_request to finish timed; median",
            "sampling": {"temperature": 0.0, "ignore_eos": True},
            "prompts": f"uniform random token ids, seed {args.seed}",
            "enable_prefix_caching": False,
            "warmup": "one cached run (max_tokens <= 5) and one recompute request on another prompt",
            "timing": "time.perf_counter, CUDA synchronised at both ends",
        },
        "results": {
            "cached": {
                "median_s_per_token": cached_median,
                "mean_s_per_token": statistics.fmean(decode_s),
                "prefill_s": prefill_s,
                "step_s": decode_s,
            },
            "recompute": {
                "median_s_per_token": recompute_median,
                "mean_s_per_token": statistics.fmean(recompute_s),
                "token_s": recompute_s,
                "num_tokens_matching_cached": num_matching,
            },
        },
        "ratio_recompute_over_cached": recompute_median / cached_median,
        "num_preemptions": num_preemptions,
    }
    env = environment(engine, args)
    line = (
        f"context {args.context_len} tokens, {args.num_decode} tokens timed, batch of 1, greedy, "
        "prefix caching off; median time per generated token"
    )
    json_path, png_path = write_results(
        args.out,
        "kv_cache_speed",
        env,
        record,
        lambda fig: _plot(fig, context_lens, decode_s, recompute_s, record["ratio_recompute_over_cached"]),
        title("Time per generated token: KV cache vs full recomputation", env, line),
    )
    print(
        f"cached: {cached_median * 1e3:.3f} ms/token (prefill {prefill_s * 1e3:.3f} ms); "
        f"recompute: {recompute_median * 1e3:.3f} ms/token; ratio {record['ratio_recompute_over_cached']:.2f}x; "
        f"{num_matching}/{args.num_decode} recomputed tokens match"
    )
    print(f"wrote {json_path} and {png_path}")
    return {"json": str(json_path), "png": str(png_path), "benchmark": "kv_cache_speed", "environment": env, **record}


def _plot(fig: Any, context_lens: list[int], cached_s: list[float], recompute_s: list[float], ratio: float) -> None:
    left = fig.add_subplot(1, 2, 1)
    left.plot(context_lens, [s * 1e3 for s in recompute_s], "o-", color="tab:red", label="recompute (no KV cache)")
    left.plot(context_lens, [s * 1e3 for s in cached_s], "o-", color="tab:blue", label="KV cache (decode step)")
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("ms per generated token")
    left.set_ylim(bottom=0)
    left.set_title("per token", fontsize=10)
    left.legend()
    right = fig.add_subplot(1, 2, 2)
    medians = [statistics.median(recompute_s) * 1e3, statistics.median(cached_s) * 1e3]
    bars = right.bar(["recompute", "KV cache"], medians, color=["tab:red", "tab:blue"])
    label_bars(right, bars, medians, "{:.3f} ms")
    right.set_ylabel("median ms per generated token")
    right.set_title(f"median (recompute / cached = {ratio:.2f}x)", fontsize=10)


if __name__ == "__main__":
    main()
