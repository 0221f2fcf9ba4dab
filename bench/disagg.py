"""Disaggregation on two GPUs: 1 prefill + 1 decode worker over NCCL against one colocated worker.

Measures, per model shape (dummy weights), in one run, two modes: "colocated" (one worker computes
the prompt and decodes) and "disaggregated" (the router reserves a lease on the decode worker, then
makes one call to the prefill worker carrying it; the prefill worker answers with the first token at
once and pushes the prompt's KV in one message after the answer):
  - tokens: greedy outputs of a few requests, one at a time, colocated vs disaggregated (equal?);
  - TTFT of `--prompt-len`-token prompts (fresh random prompts, no prefix-cache hits, one at a
    time), as the router sees it: colocated (submit -> first token) vs disaggregated
    (reserve -> prefill -> first token); per mode the median, and the paired overhead of
    disaggregated over colocated (below);
  - the time from the first token to the second (disaggregated: the KV push, which goes on after
    the answer, and the decode worker's first step lie between);
  - the KV push as the prefill worker times it (handshake + send until acknowledged, from the
    first token), from its push records (PushRecordMsg, read once the pushes have settled), and its
    bandwidth against raw NCCL send/recv of a buffer of the same size between two Ray actors on the
    same two GPUs (our NcclTransport, no gather, no handshake), median of many;
  - the transfer itself on the GPU (CUDA events): the gather into one buffer, and the send from
    the moment the pair's stream reaches it (the receiver has posted its recv by then), and their
    bandwidth against the same raw figure.
`--modes` picks among the two (default both; colocated always runs).

Side by side, in turns: the modes' workers are alive at once (bench.side_by_side: the colocated
and the prefill worker share GPU 0, the decode worker has GPU 1, each with its own share of the GPU's
memory; the prefill and decode workers are on different GPUs, so the KV crosses NVLink).
Round i sends prompt i to every mode, one request at a time, in the order bench.paired.rotation
gives (AB, BA, ...), so drift hits every mode alike: when the modes ran one after another,
colocated TTFT moved between 54.2 and 56.4 ms across runs on one 2xH200 machine, more than the
effect. The paired overhead is ttft_disaggregated[i] / ttft_colocated[i] - 1 per round; its
median and a seeded bootstrap 95% interval are reported ("paired_overhead"), beside the ratio of
medians ("ttft_overhead"). Why not one cluster.Deployment per mode: see bench.side_by_side. The
other mode's router stays open meanwhile (it polls its idle worker and refreshes its load every
0.25 s): the router's normal idle work, the same for every mode. The routers reach the workers over
the request channel, as a served router does.

Writes JSON and a PNG with the device name. Needs Ray and 2 GPUs, or runs on the CPU for a smoke
test (`--device cpu --transport gloo`, e.g. `--shapes default --shapes-dir engine/models`).

    python -m bench.disagg --shapes qwen3-0.6b,llama-3.1-8b --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from bench.common import machine_tag
from bench.paired import overhead_summary, rotation
from bench.raw_peers import raw_bandwidth, raw_bandwidths
from bench.side_by_side import ModeSpec, SideBySide
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import NCCL_WORKER_ENV
from protocol.clients import invoke
from protocol.messages import PrefillResultMsg, PushRecordMsg, TokenBatchMsg
from router import Dispatcher
from router.channels import WorkerChannels

SHAPES = Path(__file__).resolve().parent / "shapes"
WARM_ROUNDS = 2  # the first rounds pay for allocator growth and kernel selection: not reported
MODES = ("colocated", "disaggregated")


def _timed_legs(dispatcher: Dispatcher) -> dict[str, list[float]]:
    """Wraps the Dispatcher's lease and prefill legs with timers (the router's view of each)."""
    legs: dict[str, list[float]] = {"reserve_s": [], "prefill_leg_s": [], "prefill_leg_start_at": [],
                                    "prefill_leg_end_at": []}

    def timed(method: Any, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                end = time.perf_counter()
                legs[name + "_s"].append(end - start)
                if name + "_start_at" in legs:  # absolute marks: the worker's own come in its answer
                    legs[name + "_start_at"].append(start)
                    legs[name + "_end_at"].append(end)

        return call

    dispatcher._reserve = timed(dispatcher._reserve, "reserve")  # type: ignore[method-assign]
    dispatcher._prefill = timed(dispatcher._prefill, "prefill_leg")  # type: ignore[method-assign]
    call_placed = dispatcher._call_placed
    legs["submit_start_at"], legs["submit_arrived_at"] = [], []

    async def timed_call_placed(worker_id: str, call: Any, what: str) -> Any:
        start = time.perf_counter()  # NOTE: `call` is a coroutine: it starts when awaited
        arrived = await call_placed(worker_id, call, what)
        if what == "colocated worker" and isinstance(arrived, float):  # DecodeWorker.submit's arrival
            legs["submit_start_at"].append(start)
            legs["submit_arrived_at"].append(arrived)
        return arrived

    dispatcher._call_placed = timed_call_placed  # type: ignore[method-assign]
    return legs


class _FirstBatches:
    """Per (worker, request): when the worker sent the token batch that first carried the request,
    and when a router decoded it (TokenBatchMsg.sent_at; this host's clock)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], tuple[float, float]] = {}
        self._decode = TokenBatchMsg.decode.__func__  # type: ignore[attr-defined]

    def __enter__(self) -> _FirstBatches:
        original, seen = self._decode, self.seen

        def decode(cls: type[TokenBatchMsg], data: bytes) -> TokenBatchMsg:
            batch = original(cls, data)
            now = time.perf_counter()
            for row in batch.outputs:
                if row.new_token_ids:
                    seen.setdefault((batch.worker_id, row.request_id), (batch.sent_at, now))
            return batch

        TokenBatchMsg.decode = classmethod(decode)  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        TokenBatchMsg.decode = classmethod(self._decode)  # type: ignore[method-assign, assignment]


def _submit_transit(
    legs: dict[str, list[float]], first_batches: list[tuple[float, float]], warm: int
) -> dict[str, float | None]:
    rows = list(zip(legs["submit_start_at"], legs["submit_arrived_at"], first_batches))[warm:]
    if not rows:
        return {"there_median_s": None, "worker_median_s": None, "back_median_s": None}
    return {"there_median_s": statistics.median(a - s for s, a, _ in rows),
            "worker_median_s": statistics.median(b[0] - a for _, a, b in rows),
            "back_median_s": statistics.median(b[1] - b[0] for _, _, b in rows)}


def _transit(results: list[PrefillResultMsg], legs: dict[str, list[float]]) -> dict[str, float | None]:
    """The prefill call's way there (the router's leg starts -> the worker has it) and back (the
    worker answers -> the router's leg ends), medians over the requests; both clocks are this host's
    CLOCK_MONOTONIC (time.perf_counter), the router and the prefill worker being on one host."""
    pairs = [(r, s, e) for r, s, e in zip(results, legs["prefill_leg_start_at"], legs["prefill_leg_end_at"])
             if r.arrived_at > 0]
    if not pairs:
        return {"there_median_s": None, "back_median_s": None}
    return {"there_median_s": statistics.median(r.arrived_at - s for r, s, _ in pairs),
            "back_median_s": statistics.median(e - r.answered_at for r, _, e in pairs)}


async def _push_records(run: _ModeRun, prefill_workers: list[Any]) -> None:
    """The pushes of the mode's answered requests, from their prefill worker's push records once
    its pushes have settled (a push ends after its answer); one that failed has no record (and its
    request moved on, which the tokens would show)."""
    records: dict[str, PushRecordMsg] = {}
    for handle in prefill_workers:
        await invoke(handle.settle_pushes)
        for raw in await invoke(handle.push_records):
            record = PushRecordMsg.decode(raw)
            records[record.request_id] = record
    missing = [r.request_id for r in run.results if r.push_bytes and r.request_id not in records]
    if missing:
        raise RuntimeError(f"no push record for {missing}: their pushes failed after the answer (see the workers' log)")
    run.pushes = {r.request_id: records[r.request_id] for r in run.results if r.push_bytes}


@dataclass
class _ModeRun:
    """One mode's router and what it recorded, request by request (round i is request i)."""

    dispatcher: Dispatcher
    results: list[PrefillResultMsg]  # the Dispatcher's on_prefill_result
    legs: dict[str, list[float]]  # _timed_legs of the Dispatcher
    tokens: list[list[int]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    second_tokens: list[float] = field(default_factory=list)  # per TTFT round: first token -> second token
    # per TTFT round: (sent_at, decoded_at) of the token batch that first carried its request
    first_batches: list[tuple[float, float]] = field(default_factory=list)
    pushes: dict[str, PushRecordMsg] = field(default_factory=dict)  # request id -> its push (_push_records)


async def _ttft(dispatcher: Dispatcher, request_id: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from the request to its first token, and from the first token to the second (which
    ends it: disaggregated, the KV's way to the decode worker and its first step lie between)."""
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    stream = dispatcher.generate(request_id, prompt, two)
    first = await stream.__anext__()
    had_first = time.perf_counter()
    num_tokens = len(first.new_token_ids)
    async for out in stream:
        num_tokens += len(out.new_token_ids)
    if num_tokens != 2:
        raise RuntimeError(f"{request_id}: {num_tokens} tokens came, 2 were asked for")
    return had_first - start, time.perf_counter() - had_first


async def run_modes(
    side_by_side: SideBySide, prompts: list[list[int]], ttft_prompts: list[list[int]]
) -> dict[str, dict[str, Any]]:
    """Every mode's tokens (one mode after another), then the TTFT rounds: round i sends
    ttft_prompts[i] to every mode in rotation(modes, i); the first WARM_ROUNDS are not reported. The
    routers reach the workers over the request channel, as a served router does."""
    runs: dict[str, _ModeRun] = {}
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    channels = WorkerChannels(lambda handle: isinstance(handle, ActorHandle))
    try:
        await side_by_side.start(timeout_s=600)
        for name in side_by_side.modes:
            results: list[PrefillResultMsg] = []
            workers = side_by_side.workers(name)
            dispatcher = Dispatcher(
                f"bench-{name}", channels.wrap(workers), poll_timeout_s=0.5,
                on_prefill_result=results.append,
            )
            runs[name] = _ModeRun(dispatcher, results, _timed_legs(dispatcher))
        for name, run in runs.items():
            for i, prompt in enumerate(prompts):
                stream = run.dispatcher.generate(f"eq-{i}", prompt, greedy)
                run.tokens.append([t async for out in stream for t in out.new_token_ids])
            run.results.clear()
            for leg in run.legs.values():
                leg.clear()
        with _FirstBatches() as first:
            for i, prompt in enumerate(ttft_prompts):
                for name in rotation(list(runs), i):
                    ttft, second = await _ttft(runs[name].dispatcher, f"ttft-{i}", prompt)
                    runs[name].ttfts.append(ttft)
                    runs[name].second_tokens.append(second)
        for name, run in runs.items():
            ids = set(side_by_side.workers(name).decode)
            run.first_batches = [v for (worker_id, _), v in first.seen.items() if worker_id in ids]
            await _push_records(run, [side_by_side.handles[i] for i in side_by_side.workers(name).prefill])
        for run in runs.values():
            await run.dispatcher.close()
        held = {name: await side_by_side.held_blocks(name) for name in runs}
    finally:
        channels.close()
        side_by_side.shutdown()
    return {name: _mode_summary(run, held[name]) for name, run in runs.items()}


def _mode_summary(run: _ModeRun, held: dict[str, int]) -> dict[str, Any]:
    warm = WARM_ROUNDS
    results, legs, ttfts = run.results, run.legs, run.ttfts
    pushes = [run.pushes[r.request_id] for r in results[warm:] if r.push_bytes]
    return {
        "tokens": run.tokens,
        "ttft_s": ttfts[warm:],
        "ttft_median_s": statistics.median(ttfts[warm:]),
        # from the first token to the second (disaggregated: the push and the decode worker's first step)
        "second_token_median_s": statistics.median(run.second_tokens[warm:]),
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
        # the prefill call's transit each way (the leg less the worker's own time)
        "prefill_call": _transit(results[warm:], {k: v[warm:] for k, v in legs.items()}),
        # colocated: the submit call's way there, the worker's time to the batch with the first token,
        # and that batch's way back (this host's clock on both sides)
        "submit_call": _submit_transit(legs, run.first_batches, warm),
        "held_blocks_after": held,
        # per push, seconds after the first token: the handshake accepted, the send issued, the send done
        "push_marks_s": [r.push_marks_s for r in pushes],
    }


def _shape_report(
    modes: dict[str, dict[str, Any]], args: argparse.Namespace, side_by_side: SideBySide
) -> dict[str, Any]:
    """One shape's figures from its modes' results: tokens equal?, the TTFT overhead of disaggregated
    over colocated (ratio of medians, and paired), the KV push's bandwidth against raw send/recv of
    the same size (measured here)."""
    c, d = modes["colocated"], modes.get("disaggregated")
    report: dict[str, Any] = {
        "modes": modes,
        "same_tokens": None if d is None else d["tokens"] == c["tokens"],  # None: nothing to compare
        # ratio of the modes' medians (as in older results)
        "ttft_overhead": d["ttft_median_s"] / c["ttft_median_s"] - 1 if d is not None else None,
        # per round i: ttft_disaggregated[i] / ttft_colocated[i] - 1; its median and bootstrap 95% interval
        "paired_overhead": {"disaggregated": overhead_summary(d["ttft_s"], c["ttft_s"])} if d is not None else {},
        "placement": side_by_side.placement(),
        "num_gpus_per_worker": side_by_side.num_gpus_per_worker,
    }
    if d is None or not d["push_bytes"]:
        return report
    raw, raw_device = raw_bandwidths([d["push_bytes"]], args.iters, args.transport, args.device)[d["push_bytes"]]
    push_gbps = d["push_bytes"] / d["push_median_s"] / 1e9
    transfer_gbps = d["push_bytes"] / d["transfer_device_median_s"] / 1e9 if d["transfer_device_median_s"] else None
    send_gbps = d["push_bytes"] / d["send_device_median_s"] / 1e9 if d["send_device_median_s"] else None
    return {
        **report,
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--num-ttft", type=int, default=44,
                        help="TTFT rounds reported (after 2 warm-up rounds); a multiple of the number of modes puts "
                        "every mode at every position of the rotation equally often")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--device", default="cuda", help="'cpu' (with --transport gloo) for a smoke test")
    parser.add_argument("--transport", default="nccl")
    parser.add_argument("--shapes-dir", type=Path, default=SHAPES)
    parser.add_argument("--tag", default=None, help="suffix of the result files (default: the machine's, machine_tag)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each worker's share of its GPU's memory (KV cache sizing; default 0.85 / the modes, at "
                        "most 0.28): the colocated and every prefill worker share GPU 0")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"the modes to run side by side, among {', '.join(MODES)} (colocated always)")
    args = parser.parse_args(argv)
    args.tag = args.tag or machine_tag(args.device)
    ray.init(include_dashboard=False, runtime_env={"env_vars": dict(NCCL_WORKER_ENV)})
    on_gpu = args.device != "cpu"
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if on_gpu else "cpu"
    report: dict[str, Any] = {"device": device, "torch": torch.__version__, "transport": args.transport,
                              "prompt_len": args.prompt_len, "num_ttft": args.num_ttft, "warm_rounds": WARM_ROUNDS,
                              "ttft_order": "side by side: round i measures every mode, in bench.paired.rotation "
                              "order (AB, BA, ...)", "shapes": {}}
    rng = random.Random(0)
    names = [n for n in args.modes.split(",") if n]
    if unknown := [n for n in names if n not in MODES]:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    if "colocated" not in names or len(set(names)) != len(names):
        parser.error(f"--modes must include colocated, each mode once; got {names}")
    mode_specs = [ModeSpec(n, is_disaggregated=n != "colocated") for n in names]
    # NOTE: the colocated worker and every prefill worker share GPU 0, each with this share of its memory
    share = args.gpu_memory_utilization or min(0.28, 0.85 / len(mode_specs))
    for shape in args.shapes.split(","):
        started = time.perf_counter()
        model = args.shapes_dir / shape
        options = (dict(gpu_memory_utilization=share, dtype="bfloat16") if on_gpu
                   else dict(num_blocks=1024))
        engine = engine_config(str(model), load_format="dummy", device=args.device,
                               max_num_batched_tokens=max(2048, args.prompt_len), kv_cache_dtype=args.kv_cache_dtype,
                               quantization=args.quantization, **options)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
        ttft_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                        for _ in range(args.num_ttft + WARM_ROUNDS)]
        side_by_side = SideBySide(mode_specs, engine, args.transport, use_gpus=on_gpu)
        modes = asyncio.run(run_modes(side_by_side, prompts, ttft_prompts))
        for name, result in modes.items():
            print(shape, name, {k: v for k, v in result.items() if k not in ("tokens", "ttft_s")}, flush=True)
        report["shapes"][shape] = _shape_report(modes, args, side_by_side)
        report["shapes"][shape]["wall_s"] = time.perf_counter() - started
        print(shape, {k: v for k, v in report["shapes"][shape].items() if k not in ("modes", "paired_overhead")},
              flush=True)
        for name, paired in report["shapes"][shape]["paired_overhead"].items():
            print(f"{shape} {name}: paired TTFT overhead over colocated {paired['median']:+.2%} "
                  f"(95% CI {paired['ci95_low']:+.2%} .. {paired['ci95_high']:+.2%}, {args.num_ttft} rounds)",
                  flush=True)
    if on_gpu:
        sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
        sweep = raw_bandwidth(sizes, args.iters, args.transport, args.device)
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
    top_ms = 0.0
    names = [m for m in MODES if all(m in report["shapes"][s]["modes"] for s in shapes)]
    width = 0.8 / len(names)
    for k, mode in enumerate(names):
        offset = (k - (len(names) - 1) / 2) * width
        label = {"disaggregated": "disaggregated (1P1D)"}.get(mode, mode)
        medians_ms = [report["shapes"][s]["modes"][mode]["ttft_median_s"] * 1e3 for s in shapes]
        ax1.bar([i + offset for i in x], medians_ms, width=width, label=label)
        top_ms = max(top_ms, *medians_ms)
        for i, s in enumerate(shapes):
            paired = report["shapes"][s].get("paired_overhead", {}).get(mode)
            if paired:  # the paired median overhead over colocated and its 95% interval
                ax1.text(i + offset, medians_ms[i], f"{paired['median']:+.1%}\n{paired['ci95_low']:+.1%}\n"
                         f"{paired['ci95_high']:+.1%}", ha="center", va="bottom", fontsize=6.5)
    ax1.set_xticks(list(x), shapes)
    ax1.set_ylabel(f"TTFT ms (median, {report['prompt_len']}-token prompts)")
    ax1.set_ylim(0, top_ms * 1.6)  # room for the legend and the overhead labels
    ax1.legend(fontsize=7, loc="upper left", title="above the bars: paired overhead, its 95% CI",
               title_fontsize=7)
    ax2.bar([i - 0.3 for i in x], [report["shapes"][s].get("push_gbps") or 0 for s in shapes], width=0.2,
            label="KV push, end to end")
    ax2.bar([i - 0.1 for i in x], [report["shapes"][s].get("transfer_gbps") or 0 for s in shapes], width=0.2,
            label="gather + send on the GPU")
    ax2.bar([i + 0.1 for i in x], [report["shapes"][s].get("send_gbps") or 0 for s in shapes], width=0.2,
            label="send on the GPU")
    ax2.bar([i + 0.3 for i in x], [report["shapes"][s].get("raw_gbps_same_size") or 0 for s in shapes], width=0.2,
            label=f"raw {report['transport']} send/recv, same size")
    ax2.set_xticks(list(x), shapes)
    ax2.set_ylabel("GB/s")
    ax2.legend()
    fig.suptitle(f"pdserve 1P1D over {report['transport']} vs colocated — {report['device']}, "
                 f"torch {report['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
