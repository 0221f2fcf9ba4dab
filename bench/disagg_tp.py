"""Disaggregation across tensor-parallel layouts over NCCL: a prefill worker of TP=a pushing to a
decode worker of TP=b (each rank on a GPU of its own: NCCL takes one rank per GPU, so 2->1 and 1->2
need three GPUs), every prompt through the prefill worker; their greedy tokens against the offline
engine at TP=1 (float32, the embedded model's real weights: dummy weights differ per rank), and
the pushes as the prefill worker recorded them (bytes, seconds) after a first request formed the rank
pairs (`push_seconds` sums each push's time from its answer to its sends done, with the others in
flight: requests go at once).

    python -m bench.disagg_tp --layouts 2:1 1:2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layouts", nargs="+", default=["2:1", "1:2"], help="prefill_tp:decode_tp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--transport", default="nccl")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this result file")
    args = parser.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return

    import ray

    from cluster.config import ClusterConfig
    from cluster.deployment import Deployment
    from engine.llm import engine_config
    from bench.common import free_device_memory
    from kvtransfer import NCCL_WORKER_ENV
    from router import Dispatcher, DispatcherConfig, LocalPrefillConfig

    engine = dict(device=args.device, dtype="float32", num_blocks=512, block_size=16, enforce_eager=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(50, 400))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    offline_llm = LLM(**engine)
    offline = [o.outputs[0].token_ids for o in offline_llm.generate(prompts, params)]
    del offline_llm
    free_device_memory()
    ray.init(include_dashboard=False, runtime_env={"env_vars": dict(NCCL_WORKER_ENV)})
    rows = []
    for layout in args.layouts:
        p_tp, d_tp = (int(x) for x in layout.split(":"))
        config = ClusterConfig(engine=engine_config(**engine), mode="disaggregated", num_prefill=1, num_decode=1,
                               prefill_tp=p_tp, decode_tp=d_tp, transport=args.transport,
                               num_gpus_per_worker=1 if args.device == "cuda" else 0)

        async def serve() -> dict[str, Any]:
            deployment = Deployment(config)
            started = time.perf_counter()
            await deployment.start()
            ready_s = time.perf_counter() - started
            try:
                dispatcher = Dispatcher("router-tp", deployment.workers(), poll_timeout_s=0.5,
                                        config=DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote")))

                async def one(i: int, p: list[int]) -> list[int]:
                    return [t async for out in dispatcher.generate(f"r{i}", p, params) for t in out.new_token_ids]

                prefill = list(deployment.prefill.handles.values())  # type: ignore[union-attr]
                # NOTE: a first request forms every rank pair (NCCL sets up a communicator per pair); the
                # timed pushes come after, their figures the difference of the push totals
                warm = await asyncio.wait_for(one(-1, prompts[0]), 120)
                await asyncio.sleep(0.5)
                before = (await prefill[0].stats.remote()).push_totals
                t = time.perf_counter()
                tokens = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 120)
                elapsed = time.perf_counter() - t
                await dispatcher.close()
                await asyncio.sleep(0.5)
                stats = [await h.stats.remote() for h in prefill]
                held = await deployment.held_blocks()
            finally:
                deployment.shutdown()
            after = stats[0].push_totals
            totals = after.model_copy(update={f: getattr(after, f) - getattr(before, f) for f in (
                "num_pushed", "num_failed", "push_bytes", "push_seconds")})
            return {"prefill_tp": p_tp, "decode_tp": d_tp, "ready_s": ready_s, "serve_s": elapsed,
                    "tokens_equal_offline": tokens == offline and warm == offline[0],
                    "num_equal": sum(a == b for a, b in zip(tokens, offline)), "num_requests": len(prompts),
                    "num_pushed": totals.num_pushed, "num_push_failed": totals.num_failed,
                    "push_bytes": totals.push_bytes, "push_seconds": totals.push_seconds,
                    "push_gb_per_s": totals.push_bytes / totals.push_seconds / 1e9 if totals.push_seconds else None,
                    "held_blocks": held}

        row = asyncio.run(serve())
        print(json.dumps(row), flush=True)
        rows.append(row)
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu"
    slug = device.split(" ", 1)[-1].lower().replace(" ", "-") if args.device == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"disagg_tp_{slug}.json"
    path.write_text(json.dumps(
        {"benchmark": "disagg_tp", "device": device, "torch": torch.__version__, "transport": args.transport,
         "model": "default (embedded, real weights)", "dtype": "float32", "rows": rows}, indent=2) + "\n")
    ray.shutdown()
    plot(path)


def plot(path: Path) -> None:
    """Per layout: requests whose tokens equal the offline engine's, and the mean push time."""
    from bench.common import save_plot

    result = json.loads(path.read_text())
    rows = result["rows"]

    def draw(fig: Any) -> None:
        labels = [f"P TP={r['prefill_tp']} -> D TP={r['decode_tp']}" for r in rows]
        ax = fig.add_subplot(1, 2, 1)
        ax.bar(labels, [r["num_equal"] for r in rows])
        ax.set_ylabel(f"requests with the offline TP=1 tokens (of {rows[0]['num_requests']})")
        ax = fig.add_subplot(1, 2, 2)
        ax.bar(labels, [1e3 * r["push_seconds"] / max(r["num_pushed"], 1) for r in rows])
        ax.set_ylabel("push time per request, mean (ms): answer to sends done")

    save_plot(path.with_suffix(".png"), draw, f"disagg_tp: {result['device']}, {result['transport']}, "
              f"{result['model']}, {result['dtype']}")


if __name__ == "__main__":
    main()
