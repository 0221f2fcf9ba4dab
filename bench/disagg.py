"""Disaggregation on two GPUs: 1 prefill + 1 decode worker over NCCL against one colocated worker.

Measures, per model shape (dummy weights), in one run:
  - tokens: greedy outputs of a few requests, one at a time, colocated vs disaggregated (equal?);
  - TTFT of `--prompt-len`-token prompts (fresh random prompts, no prefix-cache hits, one at a
    time, median), as the router sees it: colocated (submit -> first token) vs disaggregated
    (reserve -> prefill -> KV push -> first token);
  - the KV push as the prefill worker times it (gather + handshake + send until acknowledged),
    and its bandwidth against raw NCCL send/recv of a buffer of the same size between two Ray
    actors on the same two GPUs (our NcclTransport, no gather, no handshake), median of many;
  - the transfer itself on the GPU (CUDA events): the gather into one buffer, and the send from
    the moment the pair's stream reaches it (the receiver has posted its recv by then), and their
    bandwidth against the same raw figure.
Disaggregated runs twice: the KV in one message after the prefill step (`kv_messages` 1: the
bandwidth figures above come from it) and in `--kv-messages` layer groups sent while the step
computes (the default; its TTFT is the disaggregated figure, "ttft_overhead").
Writes JSON and a PNG with the device name. Needs Ray and 2 GPUs.

    python -m bench.disagg --shapes qwen3-0.6b,llama-3.1-8b --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

from bench.raw_peers import raw_bandwidth, raw_bandwidths
from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import NCCL_WORKER_ENV
from kvtransfer.protocol import PrefillResultMsg
from router import Dispatcher

SHAPES = Path(__file__).resolve().parent / "shapes"


def _timed_legs(dispatcher: Dispatcher) -> dict[str, list[float]]:
    """Wraps the Dispatcher's lease and prefill legs with timers (the router's view of each)."""
    legs: dict[str, list[float]] = {"reserve_s": [], "prefill_leg_s": []}

    def timed(method: Any, leg: list[float]) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                leg.append(time.perf_counter() - start)

        return call

    dispatcher._reserve = timed(dispatcher._reserve, legs["reserve_s"])  # type: ignore[method-assign]
    dispatcher._prefill = timed(dispatcher._prefill, legs["prefill_leg_s"])  # type: ignore[method-assign]
    return legs


async def run_mode(config: ClusterConfig, prompts: list[list[int]], ttft_prompts: list[list[int]]) -> dict[str, Any]:
    deployment = Deployment(config)
    await deployment.start(timeout_s=600)
    results: list[PrefillResultMsg] = []
    dispatcher = Dispatcher("bench", deployment.workers(), poll_timeout_s=0.5, on_prefill_result=results.append)
    legs = _timed_legs(dispatcher)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    try:
        tokens = []
        for i, prompt in enumerate(prompts):
            tokens.append([t async for out in dispatcher.generate(f"eq-{i}", prompt, greedy) for t in out.new_token_ids])
        results.clear()
        for leg in legs.values():
            leg.clear()
        ttfts = []
        two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(ttft_prompts):
            start = time.perf_counter()
            stream = dispatcher.generate(f"ttft-{i}", prompt, two)
            await stream.__anext__()
            ttfts.append(time.perf_counter() - start)
            async for _ in stream:
                pass
        await dispatcher.close()
        held = await deployment.held_blocks()
    finally:
        deployment.shutdown()
    warm = 2  # the first requests pay for allocator growth and kernel selection
    pushes = [r for r in results[warm:] if r.push_bytes]
    return {
        "tokens": tokens,
        "ttft_s": ttfts[warm:],
        "ttft_median_s": statistics.median(ttfts[warm:]),
        "prefill_median_s": statistics.median([r.prefill_s for r in results[warm:]]) if results else None,
        "push_median_s": statistics.median([r.push_s for r in pushes]) if pushes else None,
        "push_bytes": pushes[0].push_bytes if pushes else None,
        # The transfer alone, on the GPU (CUDA events): gather into one buffer, then the NCCL send.
        "gather_device_median_s": statistics.median([r.gather_device_s for r in pushes]) if pushes else None,
        "send_device_median_s": statistics.median([r.send_device_s for r in pushes]) if pushes else None,
        "transfer_device_median_s": (
            statistics.median([r.gather_device_s + r.send_device_s for r in pushes]) if pushes else None
        ),
        # The router's legs (disaggregated): the lease call, and from choosing the prefill worker to
        # its answer (lease included); the rest of TTFT is the stream's own path to the first token.
        "reserve_median_s": statistics.median(legs["reserve_s"][warm:]) if legs["reserve_s"][warm:] else None,
        "worker_median_s": statistics.median([r.worker_s for r in results[warm:]]) if results else None,
        "prefill_leg_median_s": (
            statistics.median(legs["prefill_leg_s"][warm:]) if legs["prefill_leg_s"][warm:] else None
        ),
        "held_blocks_after": held,
        "num_streamed_messages": [r.num_streamed_messages for r in results[warm:]],
        "layers_written_at_offer": [r.layers_written_at_offer for r in results[warm:]],
        "push_marks_s": [r.push_marks_s for r in pushes],
        # on the GPU: from the forward's last layer written to the last KV group sent
        "push_tail_device_median_s": statistics.median([r.push_tail_device_s for r in pushes]) if pushes else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--num-ttft", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--device", default="cuda", help="'cpu' (with --transport gloo) for a smoke test")
    parser.add_argument("--transport", default="nccl")
    parser.add_argument("--shapes-dir", type=Path, default=SHAPES)
    parser.add_argument("--tag", default="2xh200", help="suffix of the result files")
    parser.add_argument("--kv-messages", type=int, default=ClusterConfig.model_fields["kv_messages"].default,
                        help="layer groups of the streamed disaggregated run")
    args = parser.parse_args()
    ray.init(include_dashboard=False, runtime_env={"env_vars": dict(NCCL_WORKER_ENV)})
    on_gpu = args.device != "cpu"
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if on_gpu else "cpu"
    report: dict[str, Any] = {"device": device, "torch": torch.__version__, "transport": args.transport,
                              "prompt_len": args.prompt_len, "shapes": {}}
    rng = random.Random(0)
    for shape in args.shapes.split(","):
        model = args.shapes_dir / shape
        options = dict(gpu_memory_utilization=0.85, dtype="bfloat16") if on_gpu else dict(num_blocks=1024)
        engine = engine_config(str(model), load_format="dummy", device=args.device,
                               max_num_batched_tokens=max(2048, args.prompt_len), **options)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
        ttft_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_ttft + 2)]
        modes = {}
        runs = {"colocated": ("colocated", 1), "disaggregated_one_message": ("disaggregated", 1),
                "disaggregated": ("disaggregated", args.kv_messages)}
        for name, (mode, kv_messages) in runs.items():
            config = ClusterConfig(engine=engine, mode=mode, num_prefill=1, num_decode=1, transport=args.transport,
                                   kv_messages=kv_messages)
            modes[name] = asyncio.run(run_mode(config, prompts, ttft_prompts))
            print(shape, name, {k: v for k, v in modes[name].items() if k not in ("tokens", "ttft_s")}, flush=True)
        # NOTE: bandwidth from the one-message run (a streamed push's sends are spread over the step)
        d, c, streamed = modes["disaggregated_one_message"], modes["colocated"], modes["disaggregated"]
        raw, raw_device = raw_bandwidths([d["push_bytes"]], args.iters, args.transport, args.device)[d["push_bytes"]]
        push_gbps = d["push_bytes"] / d["push_median_s"] / 1e9
        transfer_gbps = d["push_bytes"] / d["transfer_device_median_s"] / 1e9 if d["transfer_device_median_s"] else None
        send_gbps = d["push_bytes"] / d["send_device_median_s"] / 1e9 if d["send_device_median_s"] else None
        report["shapes"][shape] = {
            "modes": modes,
            "same_tokens": d["tokens"] == c["tokens"] == streamed["tokens"],
            "kv_messages": args.kv_messages,
            "ttft_overhead": streamed["ttft_median_s"] / c["ttft_median_s"] - 1,
            "ttft_overhead_one_message": d["ttft_median_s"] / c["ttft_median_s"] - 1,
            "push_gbps": push_gbps,
            "raw_gbps_same_size": raw,
            "push_fraction_of_raw": push_gbps / raw,
            # gather + send on the GPU, and the send alone, against raw send/recv of the same size
            "transfer_gbps": transfer_gbps,
            "transfer_fraction_of_raw": transfer_gbps / raw if transfer_gbps else None,
            "send_gbps": send_gbps,
            "send_fraction_of_raw": send_gbps / raw if send_gbps else None,
            # the raw send's own time on the device: the like-for-like figure for the two above
            "raw_device_gbps_same_size": raw_device,
            "transfer_fraction_of_raw_device": transfer_gbps / raw_device if transfer_gbps and raw_device else None,
        }
        print(shape, {k: v for k, v in report["shapes"][shape].items() if k != "modes"}, flush=True)
    if on_gpu:
        sweep = raw_bandwidth([1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30], args.iters, args.transport, args.device)
        report["raw_gbps_by_size"] = {str(k): v for k, v in sweep.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"disagg_{args.tag}.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / f"disagg_{args.tag}.png")
    ray.shutdown()


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(report["shapes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(shapes))
    for offset, mode in ((-0.27, "colocated"), (0.0, "disaggregated_one_message"), (0.27, "disaggregated")):
        label = {"disaggregated": "disaggregated, KV sent during the prefill"}.get(mode, mode)
        ax1.bar([i + offset for i in x], [report["shapes"][s]["modes"][mode]["ttft_median_s"] * 1e3 for s in shapes],
                width=0.27, label=label)
    ax1.set_xticks(list(x), shapes)
    ax1.set_ylabel(f"TTFT ms (median, {report['prompt_len']}-token prompts)")
    ax1.legend()
    ax2.bar([i - 0.3 for i in x], [report["shapes"][s]["push_gbps"] for s in shapes], width=0.2,
            label="KV push, end to end")
    ax2.bar([i - 0.1 for i in x], [report["shapes"][s].get("transfer_gbps") or 0 for s in shapes], width=0.2,
            label="gather + send on the GPU")
    ax2.bar([i + 0.1 for i in x], [report["shapes"][s].get("send_gbps") or 0 for s in shapes], width=0.2,
            label="send on the GPU")
    ax2.bar([i + 0.3 for i in x], [report["shapes"][s]["raw_gbps_same_size"] for s in shapes], width=0.2,
            label=f"raw {report['transport']} send/recv, same size")
    ax2.set_xticks(list(x), shapes)
    ax2.set_ylabel("GB/s")
    ax2.legend()
    fig.suptitle(f"pdserve 1P1D over {report['transport']} vs colocated — {report['device']}, torch {report['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
