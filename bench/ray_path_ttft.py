"""Time to first token through Ray alone: a Dispatcher in this process (no HTTP, no Serve router
replica) drives a running `pdserve serve`'s workers by their actor handles. Beside the offline
engine's TTFT and the router's own, it splits what serving adds into Ray + the workers' threads,
the router replica, and HTTP. Prints one JSON object: per prompt, TTFT, when the placing call and the poll carrying the first
token came back; and a no-op control call's round trip.

    python -m bench.ray_path_ttft --address HOST:PORT --prompts FILE.json
    python -m bench.ray_path_ttft --serve SHAPE_DIR --num 14 --len 512   # starts its own server (dummy weights)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from protocol.clients import invoke


class _Timed:
    """A worker handle whose `submit` and `poll` calls note when their answers came back."""

    def __init__(self, handle: Any, marks: dict[str, list[float]]) -> None:
        self._handle, self._marks = handle, marks

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        if name not in ("submit", "poll"):
            return method
        marks = self._marks.setdefault(name, [])

        async def remote(*args: Any) -> Any:
            result = await invoke(method, *args)
            marks.append(time.perf_counter())
            return result

        return SimpleNamespace(remote=remote)


async def measure(workers: Any, prompts: list[list[int]], num_warmup: int = 2) -> dict[str, Any]:
    """Per prompt after the first `num_warmup`: TTFT, when the placing call (submit) came back and
    when the poll carrying the first token came back (both from the start); and the round trip of a
    control call that does not touch the engine (health). `workers`: the worker handles (or
    in-process workers) by id, as `.prefill` and `.decode`."""
    from engine import SamplingParams
    from router import Dispatcher, Workers

    marks: dict[str, list[float]] = {}
    timed = Workers.of(prefill={k: _Timed(h, marks) for k, h in workers.prefill.items()},
                       decode={k: _Timed(h, marks) for k, h in workers.decode.items()})
    dispatcher = Dispatcher("bench-ray-path", timed)
    rows: dict[str, list[float]] = {"ttft_s": [], "submit_back_s": [], "token_poll_back_s": [], "health_rtt_s": []}
    try:
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            stream = dispatcher.generate(f"ray-path-{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                                 ignore_eos=True))
            ttft = float("nan")
            async for output in stream:
                if output.new_token_ids:
                    ttft = time.perf_counter() - started
                    break
            await stream.aclose()
            if i < num_warmup:
                continue
            rows["ttft_s"].append(ttft)
            submits = [t - started for t in marks.get("submit", []) if t > started]
            rows["submit_back_s"].append(submits[0] if submits else float("nan"))
            polls = [t - started for t in marks.get("poll", []) if t > started]
            rows["token_poll_back_s"].append(polls[0] if polls else float("nan"))
        for handle in workers.decode.values():
            for _ in range(10):
                t = time.perf_counter()
                await invoke(handle.health)
                rows["health_rtt_s"].append(time.perf_counter() - t)
    finally:
        await dispatcher.close()
    return rows


def measure_server(log: Path, prompts: list[list[int]], scratch: Path) -> dict[str, Any]:
    """This module in a child process against the running `pdserve serve` whose log is `log` (it
    names the server's Ray address): the child joins that Ray cluster."""
    found = None
    for _ in range(60):  # the CLI prints the address just after its HTTP server answers
        if found := re.search(r"Ray\s+(\S+:\d+)", log.read_text()):
            break
        time.sleep(0.5)
    if found is None:
        raise RuntimeError(f"no Ray address in {log}")
    path = scratch / "ray_path_prompts.json"
    path.write_text(json.dumps(prompts))
    done = subprocess.run([sys.executable, "-m", "bench.ray_path_ttft", "--address", found.group(1), "--prompts",
                           str(path)], capture_output=True, text=True, timeout=180, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve_and_measure(args: argparse.Namespace) -> int:
    """Starts `pdserve serve --colocated` on the shape (dummy weights) and measures it from a child process."""
    import os
    import random
    import tempfile

    from bench.goodput import servable_model_dir, serve_flags
    from bench.server_process import ServerProcess, wait_gpus_free
    from kvtransfer import NCCL_WORKER_ENV
    from kvtransfer.netaddr import free_port

    vocab = json.loads((Path(args.serve) / "config.json").read_text())["vocab_size"]
    rng = random.Random(11)
    prompts = [[rng.randrange(vocab) for _ in range(args.len)] for _ in range(args.num)]
    with tempfile.TemporaryDirectory() as scratch:
        served = servable_model_dir(Path(args.serve), Path(scratch))
        port = free_port()
        flags = serve_flags({"model": str(served), "load_format": "dummy", "dtype": "bfloat16", "device": "auto",
                             "max_num_seqs": 256, "max_num_batched_tokens": 16384})
        argv = [sys.executable, "-m", "deploy.cli", "serve", "--colocated", "--decode", "1", *flags,
                "--port", str(port), "--grpc-port", str(free_port()), "--exit-after", "600"]
        log = Path(scratch) / "server.log"
        server = ServerProcess(argv, {**os.environ, **NCCL_WORKER_ENV, "PYTHONUNBUFFERED": "1"}, log)
        try:
            server.wait_ready(f"http://127.0.0.1:{port}/v1/models", 240)
            print(json.dumps(measure_server(log, prompts, Path(scratch))))
        finally:
            server.stop(30)
            wait_gpus_free(30)
    return 0


def in_process(args: argparse.Namespace) -> int:
    """The same probes with the worker in this process (no Ray: its engine thread and this event
    loop), after the offline engine's TTFT on other prompts of the same length: what the worker's
    threads add, apart from Ray."""
    import random

    from bench.common import free_device_memory
    from bench.http_vs_offline import offline_ttfts
    from decode_worker import DecodeWorker, DecodeWorkerConfig
    from engine import EngineCore, engine_config
    from kvtransfer import LocalHub

    # a fixed KV size: the offline engine's memory is not all back (allocated) when the worker sizes its own
    config = engine_config(args.in_process, load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                           max_num_batched_tokens=4096, num_blocks=4096)
    vocab = json.loads((Path(args.in_process) / "config.json").read_text())["vocab_size"]
    rng = random.Random(12)
    num_runs = 1 + args.switch_intervals_ms.count(",")
    prompts = [[rng.randrange(vocab) for _ in range(args.len)] for _ in range((1 + num_runs) * args.num)]
    engine = EngineCore(config)
    offline = offline_ttfts(engine, prompts[: args.num])[2:]
    del engine
    free_device_memory()

    fresh = iter([prompts[i : i + args.num] for i in range(args.num, len(prompts), args.num)])

    async def run() -> dict[str, Any]:
        worker = DecodeWorker(DecodeWorkerConfig(worker_id="d0", engine=config, transport="local"),
                              transport_options={"hub": LocalHub()})
        try:
            return await measure(SimpleNamespace(prefill={}, decode={"d0": worker}), next(fresh))
        finally:
            await worker.shutdown()

    out: dict[str, Any] = {"offline_ttft_s": offline}
    for interval_ms in [float(x) for x in args.switch_intervals_ms.split(",")]:
        sys.setswitchinterval(interval_ms / 1e3)
        out[f"switch_{interval_ms}ms"] = asyncio.run(run())
    json.dump(out, sys.stdout)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the Ray address `pdserve serve` printed")
    parser.add_argument("--prompts", type=Path, help="a JSON list of token-id prompts")
    parser.add_argument("--serve", help="a model shape directory: start a server on it first")
    parser.add_argument("--in-process", help="a model shape directory: the worker in this process, no Ray")
    parser.add_argument("--switch-intervals-ms", default="5", help="--in-process: GIL switch intervals to try")
    parser.add_argument("--num", type=int, default=14)
    parser.add_argument("--len", type=int, default=512)
    args = parser.parse_args()
    if args.serve:
        return serve_and_measure(args)
    if args.in_process:
        return in_process(args)
    if not (args.address and args.prompts):
        parser.error("--address and --prompts, or --serve")
    from deploy.cli import APP_NAME, _token_auth_for

    _token_auth_for(args.address)  # NOTE: before importing ray
    import ray
    from ray import serve

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    try:
        controller = serve.get_deployment_handle("Controller", app_name=APP_NAME)
        _, prefill, decode = controller.workers.remote().result(timeout_s=60)
        # NOTE: the controller hands out clients; measure() times their targets' calls (the Ray handles)
        targets = SimpleNamespace(prefill={k: c.target for k, c in prefill.items()},
                                  decode={k: c.target for k, c in decode.items()})
        rows = asyncio.run(measure(targets, json.loads(args.prompts.read_text())))
    finally:
        ray.shutdown()
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
