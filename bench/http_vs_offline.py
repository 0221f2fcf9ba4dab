"""The serving stack's cost: 256 concurrent HTTP streams against the offline engine on the same
workload, and what the router adds to time to first token. One GPU, one run:

1. Offline: pdserve's EngineCore in this process on nano-vllm's workload (256 prompts and output
   lengths uniform in [100, 1024], seed 0, temperature 0.6, ignore EOS; bench.offline_throughput's),
   output tokens/s; then TTFT of --num-ttft lone 512-token prompts (add_request -> first token).
2. The engine is freed; `pdserve serve --colocated --decode 1` (one worker on the GPU, Ray Serve
   router and HTTP proxy in front) serves the same model; after a warm-up, the same 256 requests
   are sent at once as streaming completions (token-id prompts, loadgen's client) and output
   tokens/s = the server's usage tokens / the run's duration; then the same lone-prompt TTFTs over
   HTTP (client send -> first streamed token).

Reported: HTTP / offline throughput (goal >= 90%) and median TTFT HTTP - offline (goal <= 5 ms).
Writes http_vs_offline_<device>.json and a PNG.

    python -m bench.http_vs_offline --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import build_engine, environment, synchronize, write_results
from bench.goodput import SHAPES, ServerProcess, servable_model_dir, serve_flags, wait_gpus_free
from bench.offline_throughput import nano_vllm_workload, run_engine
from engine import EngineCore, SamplingParams
from kvtransfer import NCCL_WORKER_ENV
from kvtransfer.netaddr import free_port


def offline_ttfts(engine: EngineCore, prompts: list[list[int]]) -> list[float]:
    out = []
    for i, prompt in enumerate(prompts):
        synchronize(engine.device)
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while not any(o.new_token_ids for o in engine.step()):
            pass
        out.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step()
    return out


async def http_part(base_url: str, model: str, vocab: int, prompts: list[list[int]], max_tokens: list[int],
                    ttft_prompts: list[list[int]], jsonl: Path) -> dict[str, Any]:
    from bench.loadgen.cli import client_for, run_rate
    from bench.loadgen.config import BenchConfig

    jsonl.write_text("".join(json.dumps({"prompt": p, "max_tokens": m}) + "\n" for p, m in zip(prompts, max_tokens)))
    config = BenchConfig(base_url=base_url, model=model, workload="jsonl", dataset=jsonl, num_prompts=len(prompts),
                         temperature=0.6, vocab_size=vocab, request_timeout=600.0, is_progress=False)
    async with client_for(config) as client:
        warm = [await client.send(i, _request(p[:64], 8), time.perf_counter()) for i, p in enumerate(prompts[:4])]
        if not all(r.is_success for r in warm):
            raise RuntimeError(f"warm-up failed: {[r.error for r in warm]}")
        run = await run_rate(client, config, 0, float("inf"))
        ttfts = []
        for i, p in enumerate(ttft_prompts):
            record = await client.send(10_000 + i, _request(p, 2), time.perf_counter())
            if not record.is_success:
                raise RuntimeError(f"TTFT probe failed: {record.error}")
            ttfts.append(record.ttft)
    m = run.metrics
    return {"output_tokens": m.total_completion_tokens, "duration_s": m.duration_s,
            "output_tok_per_s": m.output_token_throughput, "num_completed": m.num_completed,
            "num_errored": m.num_errored, "num_off_length": m.num_off_length,
            "ttft_median_ms_at_256_streams": m.ttft_ms.median, "tpot_median_ms_at_256_streams": m.tpot_ms.median,
            "ttft_s": ttfts}


def _request(prompt: list[int], max_tokens: int) -> Any:
    from bench.loadgen.workloads import BenchRequest

    return BenchRequest(prompt=prompt, max_tokens=max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SHAPES / "qwen3-0.6b"))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-ttft", type=int, default=12)
    parser.add_argument("--ttft-len", type=int, default=512)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clip", type=int, default=None, help="cut prompts and outputs to this many tokens (smoke)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dummy = args.model != "default"  # the shapes have no weights; the embedded default model has
    opts = argparse.Namespace(model=args.model, load_format="dummy" if dummy else "auto",
                              dtype="bfloat16" if dummy else "auto", device=args.device, seed=0, num_threads=None,
                              quick=False, out=args.out)
    engine = build_engine(opts, max_num_seqs=256, max_num_batched_tokens=16384)
    vocab = engine.arch.vocab_size
    prompts, max_tokens = nano_vllm_workload(args.num_seqs, 0)
    prompts = [[t % vocab for t in p][: args.clip] for p in prompts]
    max_tokens = [min(m, args.clip or m) for m in max_tokens]
    rng = random.Random(7)
    ttft_prompts = [[rng.randrange(vocab) for _ in range(args.ttft_len)] for _ in range(args.num_ttft + 2)]
    run_engine(engine, [p[:64] for p in prompts[:8]], [8] * 8)  # warm-up
    record: dict[str, Any] = {"offline": run_engine(engine, prompts, max_tokens)}
    record["offline"]["ttft_s"] = offline_ttfts(engine, ttft_prompts)[2:]
    print("offline", {k: v for k, v in record["offline"].items() if k != "ttft_s"}, flush=True)
    env = environment(engine, opts)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as scratch:
        served = servable_model_dir(Path(args.model), Path(scratch)) if dummy else Path("default")
        port = free_port()
        flags = serve_flags({"model": str(served), "load_format": opts.load_format, "dtype": opts.dtype,
                             "device": args.device, "max_num_seqs": 256, "max_num_batched_tokens": 16384})
        argv = [sys.executable, "-m", "deploy.cli", "serve", "--colocated", "--decode", "1", *flags, "--port", str(port),
                "--grpc-port", str(free_port()), "--exit-after", "900"]
        server = ServerProcess(argv, {**os.environ, **NCCL_WORKER_ENV, "PYTHONUNBUFFERED": "1"},
                               args.out / "server_http_vs_offline.log")
        try:
            server.wait_ready(f"http://127.0.0.1:{port}/v1/models", 240)
            record["http"] = asyncio.run(http_part(f"http://127.0.0.1:{port}/v1", str(served), vocab, prompts,
                                                   max_tokens, ttft_prompts, Path(scratch) / "w.jsonl"))
        finally:
            record["server_stop"] = server.stop(30)
            wait_gpus_free(30)
    record["http"]["ttft_s"] = record["http"]["ttft_s"][2:]
    off, http = record["offline"], record["http"]
    record["http_over_offline_throughput"] = http["output_tok_per_s"] / off["output_tok_per_s"]
    record["ttft_median_offline_ms"] = statistics.median(off["ttft_s"]) * 1e3
    record["ttft_median_http_ms"] = statistics.median(http["ttft_s"]) * 1e3
    record["router_ttft_added_ms"] = record["ttft_median_http_ms"] - record["ttft_median_offline_ms"]
    print({k: v for k, v in record.items() if k not in ("offline", "http")}, flush=True)
    print("http", {k: v for k, v in http.items() if k != "ttft_s"}, flush=True)

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        ax1.bar(["offline engine", "HTTP, 256 streams"], [off["output_tok_per_s"], http["output_tok_per_s"]])
        ax1.set_ylabel("output tokens / s")
        ax2.bar(["offline", "HTTP"], [record["ttft_median_offline_ms"], record["ttft_median_http_ms"]])
        ax2.set_ylabel(f"median TTFT, ms ({args.ttft_len}-token prompt, alone)")

    write_results(args.out, "http_vs_offline", env, record, plot, "HTTP (Ray Serve router) vs offline engine")


if __name__ == "__main__":
    main()
