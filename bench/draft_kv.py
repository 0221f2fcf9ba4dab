"""Speculative decoding in the disaggregated path: where the draft model's KV of the prompt is
computed. Two 1P1D modes, side by side on two GPUs (bench.side_by_side), with one engine config
whose speculation drafts with a model:

  decode_prefills_draft   the prefill worker ships the target's KV only; the decode worker's draft
                          computes the prompt in its first drafting step for the request, inside a
                          step of its batch (PrefillWorkerConfig.ship_draft_kv False);
  prefill_ships_draft     the prefill worker also computes the draft's KV, after the first token on
                          a stream of its own, and ships it after the first token; the decode
                          worker's draft adopts it (ship_draft_kv True).

Measured in one run, per mode:
  - batch 1: rounds of one request (held-out text prompt, greedy, `--max-tokens` out), each round
    sending its prompt to both modes in rotating order (bench.paired.rotation): TTFT, decode time
    (first token to last) and latency; the paired ratio per round (ships over prefills) with its
    median and a seeded bootstrap 95% interval; the tokens of both modes (equal: both are exact);
  - under load: rounds of `--concurrency` closed-loop clients sending `--load-requests` requests in
    all to one mode (modes in rotating order): output tokens/s over the round, mean TTFT and mean
    time per output token after the first; paired ratios as above;
  - each decode worker's speculation counters (acceptance) and how many prompts its draft adopted.

Needs Ray and 2 GPUs, plus a trained target/draft pair (bench.train_models); or a CPU smoke test:
`--device cpu --transport gloo --target default --draft default`.

    python -m bench.draft_kv --target /tmp/pair/target --draft /tmp/pair/draft \\
        --text /tmp/pair/held_out.txt --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

from bench.paired import overhead_summary, rotation
from bench.side_by_side import ModeSpec, SideBySide
from bench.spec_decode import make_prompts
from engine import SamplingParams, SpeculativeConfig
from engine.engine import resolve_model_dir
from engine.llm import engine_config
from kvtransfer import NCCL_WORKER_ENV
from router import Dispatcher
from router.dispatch import DispatcherConfig, LocalPrefillConfig

A, B = "decode_prefills_draft", "prefill_ships_draft"  # B's figures are reported over A's
WARM_ROUNDS = 2


async def _request(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """One request's TTFT, decode time (first token to last), latency and tokens."""
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    async for out in dispatcher.generate(rid, prompt, params):
        if first is None and out.new_token_ids:
            first = time.perf_counter()
        tokens += out.new_token_ids
    end = time.perf_counter()
    assert first is not None, f"{rid} produced no token"
    return {"ttft_s": first - start, "decode_s": end - first, "latency_s": end - start, "tokens": tokens}


async def _load_round(
    dispatcher: Dispatcher, tag: str, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> dict[str, float]:
    """`concurrency` clients, each sending its next prompt as soon as its last request ended."""
    queue = list(enumerate(prompts))
    results: list[dict[str, Any]] = []

    async def client() -> None:
        while queue:
            i, prompt = queue.pop(0)
            results.append(await _request(dispatcher, f"{tag}-{i}", prompt, params))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    num_tokens = sum(len(r["tokens"]) for r in results)
    tpot = [r["decode_s"] / (len(r["tokens"]) - 1) for r in results if len(r["tokens"]) > 1]
    return {"tokens_per_s": num_tokens / wall, "wall_s": wall,
            "mean_ttft_s": statistics.mean(r["ttft_s"] for r in results), "mean_tpot_s": statistics.mean(tpot),
            "num_tokens": num_tokens}


async def run(side_by_side: SideBySide, args: argparse.Namespace) -> dict[str, Any]:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    load = SamplingParams(max_tokens=args.load_max_tokens, temperature=0.0, ignore_eos=True)
    vocab = json.loads((resolve_model_dir(args.model) / "config.json").read_text())["vocab_size"]
    num_batch1, num_load = args.rounds + WARM_ROUNDS, args.load_requests
    every = make_prompts(args, num_batch1 + (args.load_rounds + 1) * num_load, vocab, seed=1)  # NOTE: one tokenization
    batch1_prompts = every[:num_batch1]
    batch1: dict[str, list[dict[str, Any]]] = {A: [], B: []}
    loaded: dict[str, list[dict[str, float]]] = {A: [], B: []}
    report: dict[str, Any] = {}
    try:
        await side_by_side.start(timeout_s=600)
        # NOTE: every prompt through the prefill worker (the default rule prefills short ones on the decode worker)
        remote = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))
        dispatchers = {m: Dispatcher(f"bench-{m}", side_by_side.workers(m), poll_timeout_s=0.5, config=remote)
                       for m in (A, B)}
        for i, prompt in enumerate(batch1_prompts):
            for mode in rotation([A, B], i):
                batch1[mode].append(await _request(dispatchers[mode], f"b1-{i}", prompt, greedy))
        for r in range(args.load_rounds + 1):  # the first round of each mode warms it up
            prompts = every[num_batch1 + r * num_load : num_batch1 + (r + 1) * num_load]
            for mode in rotation([A, B], r):
                loaded[mode].append(
                    await _load_round(dispatchers[mode], f"l{r}", prompts, load, args.concurrency)
                )
        for d in dispatchers.values():
            await d.close()
        for mode in (A, B):
            ids = list(side_by_side.workers(mode).decode)
            report[mode] = {"decode_stats": await side_by_side.handles[ids[0]].stats.remote(),
                            "held_blocks": await side_by_side.held_blocks(mode)}
    finally:
        side_by_side.shutdown()
    return _summary(report, batch1, loaded)


def _summary(report: dict[str, Any], batch1: dict[str, list[dict[str, Any]]],
             loaded: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"modes": {}, "b_over_a": {"batch1": {}, "loaded": {}}}
    for mode in (A, B):
        b1 = batch1[mode][WARM_ROUNDS:]
        stats = report[mode]["decode_stats"]
        drafted = stats.get("num_spec_draft_tokens") or 0
        out["modes"][mode] = {
            "batch1": {k: statistics.median(r[k] for r in b1) for k in ("ttft_s", "decode_s", "latency_s")},
            "batch1_per_round": {k: [r[k] for r in b1] for k in ("ttft_s", "decode_s", "latency_s")},
            "loaded": {k: statistics.median(r[k] for r in loaded[mode][1:]) for k in loaded[mode][0]},
            "loaded_per_round": loaded[mode][1:],
            "acceptance_per_draft_token": stats.get("num_spec_accepted_tokens", 0) / drafted if drafted else None,
            "num_draft_kv_adopted": stats.get("num_draft_kv_adopted"),
            "held_blocks": report[mode]["held_blocks"],
        }
    for k in ("ttft_s", "decode_s", "latency_s"):
        out["b_over_a"]["batch1"][k] = overhead_summary([r[k] for r in batch1[B][WARM_ROUNDS:]],
                                                        [r[k] for r in batch1[A][WARM_ROUNDS:]])
    for k in ("tokens_per_s", "mean_ttft_s", "mean_tpot_s"):
        out["b_over_a"]["loaded"][k] = overhead_summary([r[k] for r in loaded[B][1:]], [r[k] for r in loaded[A][1:]])
    out["tokens_equal"] = [r["tokens"] for r in batch1[A]] == [r["tokens"] for r in batch1[B]]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", dest="model", default="default")
    parser.add_argument("--draft", default="default")
    parser.add_argument("--text", type=Path, default=None, help="held-out text for prompts (else random ids)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of a batch-1 request")
    parser.add_argument("--rounds", type=int, default=40, help="batch-1 rounds reported (after 2 warm-up rounds)")
    parser.add_argument("--num-draft-tokens", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--load-requests", type=int, default=64, help="requests of one loaded round")
    parser.add_argument("--load-max-tokens", type=int, default=64)
    parser.add_argument("--load-rounds", type=int, default=8,
                        help="loaded rounds reported per mode (after one warm-up)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--transport", default="nccl")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--tag", default="2xh200")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    on_gpu = args.device != "cpu"
    ray.init(include_dashboard=False, runtime_env={"env_vars": dict(NCCL_WORKER_ENV)},
             **({} if on_gpu else {"num_cpus": 2}))
    speculative = SpeculativeConfig(method="draft", draft_model=args.draft, num_draft_tokens=args.num_draft_tokens,
                                    disable_above_batch_size=32)
    options = (dict(gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype) if on_gpu
               else dict(num_blocks=512))
    engine = engine_config(args.model, device=args.device, max_num_batched_tokens=max(2048, args.prompt_len),
                           speculative=speculative, **options)
    modes = [ModeSpec(A, True, kv_messages=8, ship_draft_kv=False, early_handshake=True),
             ModeSpec(B, True, kv_messages=8, ship_draft_kv=True, early_handshake=True)]
    started = time.perf_counter()
    result = asyncio.run(run(SideBySide(modes, engine, args.transport, use_gpus=on_gpu), args))
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if on_gpu else "cpu"
    report = {"device": device, "torch": torch.__version__, "transport": args.transport,
              "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": time.perf_counter() - started, **result}
    for mode, m in report["modes"].items():
        print(mode, {k: v for k, v in m.items() if not k.endswith("per_round")}, flush=True)
    for phase, figures in report["b_over_a"].items():
        for k, s in figures.items():
            print(f"{phase} {k}: {B} over {A} {s['median']:+.2%} (95% CI {s['ci95_low']:+.2%} .. "
                  f"{s['ci95_high']:+.2%})", flush=True)
    print("tokens equal:", report["tokens_equal"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"draft_kv_{args.tag}.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / f"draft_kv_{args.tag}.png")
    ray.shutdown()
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    modes = list(report["modes"])
    colors = ["tab:gray", "tab:blue"]
    for ax, (key, label) in zip(axes[:2], [("ttft_s", "TTFT"), ("decode_s", "first to last token")]):
        values = [report["modes"][m]["batch1"][key] * 1e3 for m in modes]
        ax.bar(modes, values, color=colors)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom")
        s = report["b_over_a"]["batch1"][key]
        ax.set_title(f"batch 1 {label} (ms, median)\npaired {s['median']:+.1%} [{s['ci95_low']:+.1%}, "
                     f"{s['ci95_high']:+.1%}]", fontsize=9)
    values = [report["modes"][m]["loaded"]["tokens_per_s"] for m in modes]
    axes[2].bar(modes, values, color=colors)
    for x, v in enumerate(values):
        axes[2].text(x, v, f"{v:.0f}", ha="center", va="bottom")
    s = report["b_over_a"]["loaded"]["tokens_per_s"]
    axes[2].set_title(f"loaded output tok/s (median round)\npaired {s['median']:+.1%} [{s['ci95_low']:+.1%}, "
                      f"{s['ci95_high']:+.1%}]", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"draft KV in 1P1D: decode worker computes it vs prefill worker ships it — {report['device']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
