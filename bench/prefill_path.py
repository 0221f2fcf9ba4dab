"""The prefill worker's own path against a colocated worker's, on one GPU, in one process: no Ray,
no NCCL (the `local` transport clones the KV on the GPU).

Why: on two H200s, 1P1D over NCCL at the Llama-3.1-8B shape with 2,048-token prompts took 2.6 ms
longer on the prefill worker from the prompt's arrival to its first token than the colocated
worker took to the batch carrying it (bench/results/disagg_2xh200_colocated_transit.json). This
asks whether that is the prefill worker's own code (its layer hooks, the early handshake beside the
step, holding the prompt's KV, the event loop's work beside the engine thread), which shows here
too, or what only two GPUs have (NCCL's kernels beside the prefill's, the cross-GPU send), which
cannot show here. What it cannot separate: here the decode worker shares the process, so its side
of the handshake (posting receives, landing the KV) runs beside the prefill worker's engine thread
too, which on two GPUs it does not.

Modes, measured in turns (round i measures every mode, in bench.paired.rotation order), a fresh
random prompt each round, the first WARM_ROUNDS not reported:
- colocated: a DecodeWorker; `submit`, then its token batches until the one with the first token.
  Worker time: arrival (submit's answer) -> that batch sent (TokenBatchMsg.sent_at).
- prefill: a PrefillWorker and a DecodeWorker (local transport): `reserve`, then `prefill` with the
  lease, its answer carrying prefill_s (arrival -> first token: the worker time to compare) and
  push_s (first token -> the KV's sends done: from the worker's push_records when it answered before the
  push, PrefillWorkerConfig.answer_before_push, the default); the KV in --kv-messages layer groups.
Both times are this process's clock. Reported per mode: TTFT (the caller's view) and worker time,
medians, and the paired worker-time difference prefill - colocated per round with a bootstrap 95%
interval. Writes prefill_path_<device>.json and a PNG.

    python -m bench.prefill_path --model bench/shapes/llama-3.1-8b --out bench/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import save_plot
from bench.paired import bootstrap_median_ci, rotation
from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from kvtransfer.protocol import (
    GenerateRequestMsg,
    LeaseMsg,
    PrefillResultMsg,
    PrefillTaskMsg,
    ReserveMsg,
    TokenBatchMsg,
)
from prefill_worker import PrefillWorker, PrefillWorkerConfig

SHAPES = Path(__file__).resolve().parent / "shapes"
WARM_ROUNDS = 3
ROUTER = "bench"
TWO = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # the first token, then one decode step


async def _until_finished(worker: DecodeWorker, request_id: str, deadline_s: float = 60.0) -> tuple[float, float]:
    """Polls `worker` until `request_id` finishes: (when the batch with its first token was sent, and
    when this caller had it), both on this process's clock."""
    first: tuple[float, float] | None = None
    end = time.perf_counter() + deadline_s
    while time.perf_counter() < end:
        batch = TokenBatchMsg.decode(await worker.poll(ROUTER, 1.0))
        now = time.perf_counter()
        for row in batch.outputs:
            if row.request_id != request_id:
                continue
            if row.error:
                raise RuntimeError(f"{request_id} failed on {worker.worker_id}: {row.error}")
            if first is None and row.new_token_ids:
                first = (batch.sent_at, now)
            if row.finish_reason is not None:
                if first is None:
                    raise RuntimeError(f"{request_id} finished ({row.finish_reason}) without a token")
                return first
    raise TimeoutError(f"{request_id} did not finish within {deadline_s} s")


async def colocated_round(worker: DecodeWorker, request: GenerateRequestMsg) -> dict[str, float]:
    started = time.perf_counter()
    arrived = await worker.submit(request.encode())
    sent, had = await _until_finished(worker, request.request_id)
    return {"ttft_s": had - started, "worker_s": sent - arrived}


async def prefill_round(prefill: PrefillWorker, decode: DecodeWorker, request: GenerateRequestMsg) -> dict[str, float]:
    rid = request.request_id
    started = time.perf_counter()
    raw = await decode.reserve(ReserveMsg(request_id=rid, num_prompt_tokens=len(request.prompt_token_ids),
                                          router_id=ROUTER).encode())
    if raw is None:
        raise RuntimeError(f"decode worker has no room for {rid}: raise --num-blocks")
    task = PrefillTaskMsg(request=request, lease=LeaseMsg.decode(raw)).encode()
    result = PrefillResultMsg.decode(await prefill.prefill(task, decode))
    ttft = time.perf_counter() - started
    if result.error is not None:
        raise RuntimeError(f"prefill of {rid}: {result.error}")
    await _until_finished(decode, rid)  # its second token: the sequence went on there
    if result.push_pending:  # answered before its push (PrefillWorkerConfig.answer_before_push)
        await prefill.settle_pushes()
        records = [PrefillResultMsg.decode(r) for r in await prefill.push_records()]
        record = next((r for r in reversed(records) if r.request_id == rid), None)
        if record is None:
            raise RuntimeError(f"the push of {rid} after its answer failed (the prefill worker's log says how)")
        result = result.with_push(record)
    return {"ttft_s": ttft, "worker_s": result.prefill_s, "push_s": result.push_s,
            "num_streamed_messages": float(result.num_streamed_messages)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model if args.model.is_dir() else SHAPES / str(args.model)
    engine = engine_config(str(model), load_format="dummy", device=args.device, num_blocks=args.num_blocks,
                           max_num_batched_tokens=max(2048, args.prompt_len),
                           **({"dtype": "bfloat16"} if args.device != "cpu" else {}))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    hub = LocalHub()
    colocated = DecodeWorker(DecodeWorkerConfig(worker_id="colocated", engine=engine, transport="local"),
                             transport_options={"hub": hub})
    decode = DecodeWorker(DecodeWorkerConfig(worker_id="decode", engine=engine, transport="local"),
                          transport_options={"hub": hub})
    prefill = PrefillWorker(PrefillWorkerConfig(worker_id="prefill", engine=engine, transport="local",
                                                kv_messages=_kv_messages(args), early_handshake=args.early_handshake,
                                                answer_before_push=args.answer_before_push),
                            transport_options={"hub": hub})
    rng = random.Random(0)
    rows: dict[str, list[dict[str, float]]] = {"colocated": [], "prefill": []}
    try:
        for i in range(WARM_ROUNDS + args.rounds):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            for mode in rotation(list(rows), i):
                request = GenerateRequestMsg(request_id=f"{mode}-{i}", prompt_token_ids=prompt, params=TWO,
                                             router_id=ROUTER)
                row = (await colocated_round(colocated, request) if mode == "colocated"
                       else await prefill_round(prefill, decode, request))
                if i >= WARM_ROUNDS:
                    rows[mode].append(row)
        held = {w.worker_id: await w.check_integrity() for w in (colocated, decode, prefill)}
    finally:
        for w in (colocated, decode, prefill):
            await w.shutdown()
    diffs = [p["worker_s"] - c["worker_s"] for p, c in zip(rows["prefill"], rows["colocated"])]
    low, high = bootstrap_median_ci(diffs)
    summary = {mode: {key: statistics.median(r[key] for r in mode_rows) for key in mode_rows[0]}
               for mode, mode_rows in rows.items()}
    return {"rows": rows, "summary": summary, "held_blocks_after": held,
            "worker_s_difference": {"median": statistics.median(diffs), "ci95_low": low, "ci95_high": high,
                                    "per_round": diffs}}


def _kv_messages(args: argparse.Namespace) -> int:
    """The layer groups asked for; one message without the early handshake (groups need it)."""
    return args.kv_messages if args.early_handshake else 1


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SHAPES / "llama-3.1-8b", help="a shape dir (dummy weights)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--kv-messages", type=int, default=8, help="the prefill worker's KV layer groups")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks of each worker")
    parser.add_argument("--answer-before-push", action=argparse.BooleanOptionalAction, default=True,
                        help="PrefillWorkerConfig.answer_before_push (off: the answer waits for the KV push)")
    parser.add_argument("--early-handshake", action=argparse.BooleanOptionalAction, default=True,
                        help="PrefillWorkerConfig.early_handshake (off: the KV goes in one message after the step, "
                        "whatever --kv-messages says)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run (default: Python's, 5 ms): how long a thread "
                        "that wants the GIL waits before the holder is asked to let go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.rounds < 1:
        parser.error(f"--prompt-len and --rounds must be >= 1, got {args.prompt_len} and {args.rounds}")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    record = asyncio.run(run(args))
    on_gpu = args.device != "cpu"
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    record = {"benchmark": "prefill_path", "device": device, "torch": torch.__version__, "model": str(args.model),
              "prompt_len": args.prompt_len, "rounds": args.rounds, "warm_rounds": WARM_ROUNDS,
              "kv_messages": _kv_messages(args), "early_handshake": args.early_handshake,
              "answer_before_push": args.answer_before_push,
              "switch_interval_s": sys.getswitchinterval(), **record}
    print(json.dumps({k: record[k] for k in ("device", "summary", "held_blocks_after")}), flush=True)
    diff = record["worker_s_difference"]
    print(f"prefill worker - colocated worker, arrival -> first token: {diff['median'] * 1e3:+.2f} ms "
          f"(95% CI {diff['ci95_low'] * 1e3:+.2f} .. {diff['ci95_high'] * 1e3:+.2f}, {args.rounds} rounds)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = device.lower().replace(" ", "-")
    path = args.out / f"prefill_path_{slug}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        s = record["summary"]
        modes = list(s)
        ax1.bar(modes, [s[m]["ttft_s"] * 1e3 for m in modes], label="TTFT (caller)")
        ax1.bar(modes, [s[m]["worker_s"] * 1e3 for m in modes], width=0.4, label="worker: arrival -> first token")
        ax1.set_ylabel("ms (median)")
        ax1.legend(fontsize=8)
        ax2.plot([d * 1e3 for d in diff["per_round"]], marker="o")
        ax2.axhline(diff["median"] * 1e3, color="k", lw=0.8)
        ax2.set_xlabel("round")
        ax2.set_ylabel("worker time, prefill - colocated (ms)")

    save_plot(path.with_suffix(".png"), plot, f"prefill worker vs colocated, one process, {device}, "
              f"{args.prompt_len}-token prompts, {args.model.name}")
    print(path)
    return path


if __name__ == "__main__":
    main()
