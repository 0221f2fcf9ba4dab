"""Static vs continuous batching on the textbook workload: mixed output lengths in a few slots.

Workload: N requests (32; 16 with --quick) of random-token prompts (32 tokens, fixed seed),
interleaved short/long: even-numbered requests stop at 50 output tokens, odd-numbered at 200
(`ignore_eos=True`, greedy), so every request produces exactly its `max_tokens`.
The engine has 8 slots (`max_num_seqs=8`) and prefix caching off, so neither mode reuses the
other's prompt blocks.

- static: the requests in batches of 8, in order; a batch is admitted only when the whole
  previous one has finished, so a batch runs as long as its longest request (the way
  `LLM.generate` over fixed batches behaves) and finished short requests leave idle slots.
- continuous: a closed loop of 8 clients over the same queue; whenever a request finishes, its
  client sends the next one, which joins the running batch at the next engine step.

Both drive `EngineCore` through its public API (`add_request`, `step`, `has_unfinished`) after
one warm-up run. Measured: wall time (`time.perf_counter` around the whole run, CUDA
synchronised at both ends; the median of 3 runs of each mode, alternating which goes first),
engine steps, output tokens/s and requests/s, and their ratio continuous / static.

    .venv/bin/python -m bench.batching [--quick] [--model DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import base_parser, build_engine, check_no_leak, environment, label_bars, random_prompts, timed
from bench.common import title, write_results
from engine import EngineCore, SamplingParams

MODES = ("static", "continuous")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # per request; interleaved short, long, short, ...

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class ModeResult:
    wall_s: float  # the median over the repeats
    wall_s_all: list[float]  # every repeat, in the order run
    num_steps: int
    num_requests: int
    num_output_tokens: int
    num_preemptions: int  # KV cache too small for the slots: requests were recomputed
    tokens_per_s: float
    requests_per_s: float
    mean_batch_size: float  # output tokens per step: every running request emits one token a step


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    prompts = random_prompts(args.num_requests, args.prompt_len, vocab_size, args.seed)
    lengths = [args.short_tokens if i % 2 == 0 else args.long_tokens for i in range(args.num_requests)]
    return Workload(prompts, lengths)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def run_static(engine: EngineCore, work: Workload, num_slots: int, tag: str) -> tuple[int, int, int]:
    """Batches of `num_slots`, each run to completion before the next. Returns (steps, requests, tokens)."""
    num_steps = num_finished = num_tokens = 0
    for first in range(0, work.num_requests, num_slots):
        for i in range(first, min(first + num_slots, work.num_requests)):
            engine.add_request(f"{tag}-{i}", work.prompts[i], _params(work.max_tokens[i]))
        while engine.has_unfinished():
            for out in engine.step():
                num_tokens += len(out.new_token_ids)
                num_finished += out.finish_reason is not None
            num_steps += 1
    return num_steps, num_finished, num_tokens


def run_continuous(engine: EngineCore, work: Workload, num_slots: int, tag: str) -> tuple[int, int, int]:
    """A closed loop of `num_slots` clients: each finish sends the next request. Returns (steps, requests, tokens)."""
    queue = deque(range(work.num_requests))

    def send() -> None:
        i = queue.popleft()
        engine.add_request(f"{tag}-{i}", work.prompts[i], _params(work.max_tokens[i]))

    for _ in range(min(num_slots, len(queue))):
        send()
    num_steps = num_finished = num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                num_finished += 1
                if queue:
                    send()  # NOTE: after the step: the new request joins at the next step
        num_steps += 1
    return num_steps, num_finished, num_tokens


RUNNERS = {"static": run_static, "continuous": run_continuous}


@dataclass(frozen=True, order=True)
class Run:
    wall_s: float  # first: runs sort by wall time
    num_steps: int
    num_requests: int
    num_output_tokens: int
    num_preemptions: int


def measure(engine: EngineCore, mode: str, work: Workload, num_slots: int, repeat: int) -> Run:
    """One timed run, checked for leaked blocks and for the counts that ignore_eos promises."""
    preempted_before = engine.stats().num_preemptions
    wall_s, (num_steps, num_requests, num_tokens) = timed(
        engine.device, lambda: RUNNERS[mode](engine, work, num_slots, f"{mode}{repeat}")
    )
    check_no_leak(engine)
    expected = sum(work.max_tokens)
    if num_requests != work.num_requests or num_tokens != expected:
        raise RuntimeError(
            f"{mode}: finished {num_requests}/{work.num_requests} requests with {num_tokens} output tokens; "
            f"expected {expected} (ignore_eos: every request runs to max_tokens; is max_model_len too small?)"
        )
    return Run(wall_s, num_steps, num_requests, num_tokens, engine.stats().num_preemptions - preempted_before)


def summarize(runs: list[Run]) -> ModeResult:
    """The run of median wall time (the lower middle of an even count).

    Steps and counts are the same in every run: greedy, ignore_eos, one engine.
    """
    run = sorted(runs)[(len(runs) - 1) // 2]
    return ModeResult(
        wall_s=run.wall_s,
        wall_s_all=[r.wall_s for r in runs],
        num_steps=run.num_steps,
        num_requests=run.num_requests,
        num_output_tokens=run.num_output_tokens,
        num_preemptions=run.num_preemptions,
        tokens_per_s=run.num_output_tokens / run.wall_s,
        requests_per_s=run.num_requests / run.wall_s,
        mean_batch_size=run.num_output_tokens / run.num_steps,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=None, help="Requests in the queue (32; 16 with --quick).")
    parser.add_argument("--num-slots", type=int, default=8, help="Concurrent slots: batch size and max_num_seqs.")
    parser.add_argument("--prompt-len", type=int, default=32, help="Prompt length in tokens.")
    parser.add_argument("--short-tokens", type=int, default=50, help="max_tokens of the short requests.")
    parser.add_argument("--long-tokens", type=int, default=200, help="max_tokens of the long requests.")
    parser.add_argument("--repeats", type=int, default=None, help="Timed runs of each mode, alternating (3; 1 quick).")
    args = parser.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 16 if args.quick else 32
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    for name in ("num_requests", "num_slots", "prompt_len", "short_tokens", "long_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # NOTE: synchronous steps: this bench counts steps, and asynchronous scheduling reports a step's
    # tokens one call later (one more call to drain).
    engine = build_engine(args, max_num_seqs=args.num_slots, enable_prefix_caching=False, async_scheduling=False)
    work = make_workload(args, engine.arch.vocab_size)
    warmup = Workload(work.prompts[: args.num_slots], [min(8, n) for n in work.max_tokens[: args.num_slots]])
    run_static(engine, warmup, args.num_slots, "warmup")
    check_no_leak(engine)

    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:  # NOTE: alternate, so order favours neither
            runs[mode].append(measure(engine, mode, work, args.num_slots, repeat))
    results = {mode: summarize(runs[mode]) for mode in MODES}
    static, continuous = results["static"], results["continuous"]
    workload = {
        "num_requests": work.num_requests,
        "num_slots": args.num_slots,
        "max_num_seqs": args.num_slots,
        "prompt_len": args.prompt_len,
        "short_max_tokens": args.short_tokens,
        "long_max_tokens": args.long_tokens,
        "order": "interleaved: even-numbered requests short, odd-numbered long",
        "max_tokens": work.max_tokens,
        "sampling": {"temperature": 0.0, "ignore_eos": True},
        "prompts": f"uniform random token ids, seed {args.seed}",
        "enable_prefix_caching": False,
        "warmup": f"one static batch of {len(warmup.prompts)} requests, max_tokens <= 8",
        "repeats": args.repeats,
        "timing": "time.perf_counter around the whole run, CUDA synchronised at both ends; modes alternate "
        "(static first on even repeats); wall_s is the median over the repeats",
    }
    record = {
        "workload": workload,
        "results": {mode: asdict(r) for mode, r in results.items()},
        "ratio_continuous_over_static": {
            "tokens_per_s": continuous.tokens_per_s / static.tokens_per_s,
            "requests_per_s": continuous.requests_per_s / static.requests_per_s,
            "num_steps": continuous.num_steps / static.num_steps,
        },
    }
    env = environment(engine, args)
    line = (
        f"{work.num_requests} requests, {args.num_slots} slots, prompt {args.prompt_len} tokens, "
        f"max_tokens {args.short_tokens}/{args.long_tokens} interleaved, greedy, ignore_eos"
    )
    plot_title = title("Static vs continuous batching", env, line)
    json_path, png_path = write_results(args.out, "batching", env, record, lambda fig: _plot(fig, results), plot_title)
    _report(results, record["ratio_continuous_over_static"], json_path, png_path)
    return {"json": str(json_path), "png": str(png_path), "benchmark": "batching", "environment": env, **record}


def _plot(fig: Any, results: dict[str, ModeResult]) -> None:
    colors = ["tab:gray", "tab:blue"]
    for index, (field, label) in enumerate([("tokens_per_s", "output tokens/s"), ("requests_per_s", "requests/s")]):
        ax = fig.add_subplot(1, 2, index + 1)
        values = [getattr(results[m], field) for m in MODES]
        bars = ax.bar(MODES, values, color=colors)
        label_bars(ax, bars, values, "{:.1f}" if field == "tokens_per_s" else "{:.2f}")
        ratio = values[1] / values[0]
        ax.set_title(f"{label} (continuous / static = {ratio:.2f}x)", fontsize=10)
        ax.set_ylabel(label)
        ax.set_xticks(range(len(MODES)), [f"{m}\n{results[m].num_steps} steps" for m in MODES])


def _report(results: dict[str, ModeResult], ratio: dict[str, float], json_path: Any, png_path: Any) -> None:
    for mode, r in results.items():
        print(
            f"{mode:>10}: {r.wall_s:7.3f} s, {r.num_steps:4d} steps, {r.num_output_tokens} tokens, "
            f"{r.tokens_per_s:9.1f} tok/s, {r.requests_per_s:7.2f} req/s, mean batch {r.mean_batch_size:.2f}"
        )
    print(f"continuous / static: {ratio['tokens_per_s']:.2f}x tok/s, {ratio['requests_per_s']:.2f}x req/s")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
