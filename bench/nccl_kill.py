"""Kill the decode worker mid-transfer over NCCL (two GPUs): does the prefill worker get its GPU
back and serve the next request?

One prefill worker (GPU 0) and one decode worker (GPU 1) under a ClusterController that replaces
dead workers, their transport the fault wrapper around NCCL. The decode worker is armed to drop
its next receive: it never posts the NCCL recv, so the prefill worker's NCCL send of a long
prompt's KV is launched and stays in flight (the peer never matches it). While it is in flight
the decode worker's process is killed (`ray.kill`). Then, measured from the kill:

- the in-flight request: migrated and completed, or ended with a clear error (never a hang);
- the first new request served in full (its prefill runs on the prefill worker's GPU, so this
  shows the GPU was recovered: shared/gpu/README.md says a stuck NCCL op otherwise blocks all later
  GPU work in that process), and the cluster whole again with no KV block held anywhere;
- the prefill worker's own figures (pairs dropped) where it reports them.

Writes nccl_kill_<tag>.json. Needs Ray and 2 GPUs; `--device cpu --transport gloo` is a smoke
test of the script (gloo's recv side fails fast, so it is not the NCCL case).

    python -m bench.nccl_kill --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import ray
import torch

from bench.common import machine_tag
from cluster.config import ClusterConfig
from decode_worker import DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import NCCL_WORKER_ENV
from kvtransfer.fault import FaultRule
from prefill_worker import PrefillWorkerConfig
from router.dispatch import DispatcherConfig, LocalPrefillConfig
from tests.chaos.harness import Chaos, Outcome

SHAPES = Path(__file__).resolve().parent / "shapes"


async def scenario(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = args.device != "cpu"
    options = {"gpu_memory_utilization": 0.85, "dtype": "bfloat16"} if on_gpu else {"num_blocks": 512}
    model = SHAPES / args.shape if on_gpu else "default"
    engine = engine_config(str(model), load_format="dummy" if on_gpu else "auto", device=args.device,
                           max_num_batched_tokens=max(2048, args.prompt_len), **options)
    config = ClusterConfig(engine=engine, mode="disaggregated", num_prefill=1, num_decode=1, transport=args.transport,
                           prefill=PrefillWorkerConfig(transfer_timeout_s=args.transfer_timeout_s),
                           decode=DecodeWorkerConfig(transfer_timeout_s=args.transfer_timeout_s, lease_ttl_s=30.0))
    dispatch = DispatcherConfig(max_capacity_wait_s=60.0, call_timeout_s=30.0, stall_timeout_s=60.0,
                                prefill_timeout_s=120.0, failed_worker_cooldown_s=2.0,
                                local_prefill=LocalPrefillConfig(rule="remote"))  # NOTE: the push is the point
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"] if on_gpu else 2048
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(4, vocab) for _ in range(n)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    chaos = Chaos(config, dispatch)
    record: dict[str, Any] = {"shape": args.shape, "prompt_len": args.prompt_len, "transport": args.transport,
                              "transfer_timeout_s": args.transfer_timeout_s}
    t0 = time.monotonic()
    await chaos.start(timeout_s=600)
    await chaos.wait_full_and_drained(timeout_s=300)
    record["startup_s"] = round(time.monotonic() - t0, 2)
    try:
        warm = await chaos.generate(prompt(args.prompt_len), params, Outcome())  # pairs the two workers
        record["warm_request_ok"] = warm.error is None and len(warm.tokens) == params.max_tokens
        (decode_id, decode), = chaos.handles("decode").items()
        armed_at = time.time()
        await decode.arm_fault.remote(FaultRule(action="drop", op="recv", nth=1).encode())
        victim = asyncio.create_task(chaos.generate(prompt(args.prompt_len), params, Outcome()))
        fired_at = await chaos.fault_fired_at("decode", since=armed_at, timeout_s=120)
        await asyncio.sleep(args.in_flight_s)  # the prefill worker's send is posted and unmatched
        ray.kill(decode, no_restart=True)
        killed_at = time.time()
        record["drop_fired_after_arming_s"] = round(fired_at - armed_at, 3)
        served_at = await chaos.probe_until_served(prompt(args.prompt_len), params, timeout_s=240)
        record["next_request_served_after_kill_s"] = round(served_at - killed_at, 3)
        out = await asyncio.wait_for(victim, 240)
        record["in_flight_request"] = {
            "completed": out.error is None and len(out.tokens) == params.max_tokens,
            "error": repr(out.error) if out.error else None,
            "ended_after_kill_s": round(out.finished_at - killed_at, 3),
        }
        held = await chaos.wait_full_and_drained(timeout_s=300)
        record["whole_and_drained_after_kill_s"] = round(time.time() - killed_at, 3)
        record["held_blocks_after"] = held
        record["replaced_decode_worker"] = decode_id not in chaos.handles("decode")
        prefill = next(iter(chaos.handles("prefill").values()))
        try:
            stats = await asyncio.wait_for(prefill.stats.remote(), 10)  # a WorkerStatsMsg
            record["prefill_worker_stats"] = stats.model_dump(mode="json")
        except Exception as err:  # noqa: BLE001 - figures only
            record["prefill_worker_stats"] = repr(err)
        again = await chaos.generate(prompt(args.prompt_len), params, Outcome())
        record["request_after_drain_ok"] = again.error is None and len(again.tokens) == params.max_tokens
    finally:
        await chaos.stop()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--transfer-timeout-s", type=float, default=5.0)
    parser.add_argument("--in-flight-s", type=float, default=0.5, help="how long the send is left unmatched")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--transport", default="nccl")
    parser.add_argument("--tag", default=None, help="suffix of the result file (default: the machine's, machine_tag)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    args.tag = args.tag or machine_tag(args.device)
    env = dict(NCCL_WORKER_ENV) if args.device != "cpu" else {"GLOO_SOCKET_IFNAME": "lo"}
    os.environ.update(env)
    ray.init(include_dashboard=False, runtime_env={"env_vars": env})
    device = (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if args.device != "cpu" else "cpu")
    record = {"device": device, "torch": torch.__version__, **asyncio.run(scenario(args))}
    print(json.dumps(record, indent=1, default=str), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"nccl_kill_{args.tag}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()
