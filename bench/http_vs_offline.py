"""The serving stack's cost: 256 concurrent HTTP streams against the offline engine on the same
workload, and what the router adds to time to first token. One GPU, one run:

1. Offline: pdserve's EngineCore in this process on nano-vllm's workload (256 prompts and output
   lengths uniform in [100, 1024], seed 0, temperature 0.6, ignore EOS; bench.offline_throughput's),
   output tokens/s; then TTFT of --num-ttft lone 512-token prompts (add_request -> first token).
2. The engine is freed; `pdserve serve --colocated --decode 1` (one worker on the GPU, Ray Serve
   router replicas in front) serves the same model; after the offline engine's warm-up (the
   workload cut to 16 output tokens, all at once), the same 256 requests are sent at once as
   streaming completions (token-id prompts, loadgen's client) and output tokens/s = the server's
   usage tokens / the run's duration; then the same lone-prompt TTFTs over HTTP (client send ->
   first streamed token). Prefix caching is on in both, so both warm-ups leave the prompts cached.

Reported: HTTP / offline throughput (goal >= 90%) and median TTFT HTTP - offline (goal <= 5 ms),
for each server variant asked for (--variants), one after another on the same GPU:

- `r1`, `r2`, `r4`: 1, 2 or 4 router replicas (`--num-router-replicas`), each serving --port itself
  (router/http_server.py; the kernel spreads the client's connections over them). Serve's proxy,
  Serve's direct ingress (one replica per port) and its throughput-optimized settings were measured
  here before (http_vs_offline_*_channel, _worker_cpu) and are no longer ways to serve.

With --workers N (issue 29's two GPUs: goal 1.9x), N colocated workers serve N times the workload
against the one offline engine's rate, sent by --clients processes (default N; one Python client was
near a core busy streaming 512 requests, so it could cap the figure). Each client process first sends
its share cut short, as the one client's warm-up does, so that every timed stream rides a connection
already open.

Where the time goes, per variant: the CPU each Ray process (proxy, router replicas, the worker) and
the client spent during the 256-stream run, as a fraction of one core; and the router's own mean
TTFT over the lone prompts (its Prometheus histogram: request admitted -> first token at the
router), which splits the TTFT added into HTTP/proxy and router/worker parts.
Writes http_vs_offline_<device>.json and a PNG.

    python -m bench.http_vs_offline --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import build_engine, environment, free_device_memory, save_plot, synchronize, write_results
from bench.goodput import SHAPES, servable_model_dir, serve_flags
from bench.server_process import ServerProcess, scrape_metrics, wait_gpus_free
from bench.offline_throughput import nano_vllm_workload, run_engine
from bench.ray_path_ttft import measure_server
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


VARIANTS: dict[str, list[str]] = {f"r{n}": ["--num-router-replicas", str(n)] for n in (1, 2, 4)}  # name -> serve flags


def ray_cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds (user + system) so far) of every Ray actor/worker process and this one.
    The name is the process title's first word up to a dot (Ray retitles an actor by its running method)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if not (title.startswith("ray::") or int(pid) == os.getpid()):
            continue
        name = "bench client" if int(pid) == os.getpid() else title.split()[0].split(".")[0]
        out[int(pid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


# series summed over the server (every router replica, every worker): the router's TTFT histogram, prompt tokens
# and those found in prefix caches; and per worker (its label), its engine thread's steps and seconds in them
_SUMMED = ("pdserve:time_to_first_token_seconds_sum", "pdserve:time_to_first_token_seconds_count",
           "pdserve:prompt_tokens_total", "pdserve:prefix_cache_hit_tokens_total")
_PER_WORKER = ("pdserve:engine_steps", "pdserve:engine_step_seconds", "pdserve:engine_step_device_seconds",
               "pdserve:worker_requests_joined")


def served_counts(base_url: str) -> dict[str, float]:
    """The series above from the server's /metrics: `name` summed, or `name{worker}` per worker."""
    out: dict[str, float] = {}
    for line in scrape_metrics(base_url.removesuffix("/v1")).splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _SUMMED:
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
        elif name in _PER_WORKER:
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[f"{name}{{{worker}}}"] = float(line.split()[-1])
    return out


def _served_figures(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, Any]:
    """What the server did during the timed run: the share of its prompt tokens served from prefix caches
    (the warm-up left every prompt cached somewhere: a miss is a prompt sent where it was not), and per
    worker its steps, their mean wall and device time, and the share of the run its engine thread was in one."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt = delta("pdserve:prompt_tokens_total")
    workers = sorted({k.split("{", 1)[1][:-1] for k in after if k.startswith("pdserve:engine_steps{")})
    per_worker = {}
    for w in workers:
        steps = delta(f"pdserve:engine_steps{{{w}}}")
        seconds = delta(f"pdserve:engine_step_seconds{{{w}}}")
        per_worker[w] = {"requests": int(delta(f"pdserve:worker_requests_joined{{{w}}}")),
                         "steps": int(steps), "step_ms_mean": seconds / steps * 1e3 if steps else None,
                         "device_ms_mean": delta(f"pdserve:engine_step_device_seconds{{{w}}}") / steps * 1e3
                         if steps else None, "in_steps_share_of_run": seconds / wall_s}
    count = delta("pdserve:time_to_first_token_seconds_count")
    return {"prefix_cache_hit_share": delta("pdserve:prefix_cache_hit_tokens_total") / prompt if prompt else None,
            # admitted at a router -> its first token there (the client's TTFT adds its send, HTTP, the reply)
            "router_ttft_mean_ms_during_run": delta("pdserve:time_to_first_token_seconds_sum") / count * 1e3
            if count else None, "workers_during_run": per_worker}


def _config(base_url: str, model: str, vocab: int, prompts: list[list[int]], max_tokens: list[int],
            jsonl: Path) -> Any:
    from loadgen.config import BenchConfig

    jsonl.write_text("".join(json.dumps({"prompt": p, "max_tokens": m}) + "\n" for p, m in zip(prompts, max_tokens)))
    return BenchConfig(base_url=base_url, model=model, workload="jsonl", dataset=jsonl, num_prompts=len(prompts),
                       temperature=0.6, vocab_size=vocab, request_timeout=600.0, is_progress=False)


def _figures(m: Any) -> dict[str, Any]:
    """A stream run's figures from its loadgen Metrics (one client's run, or every client's records merged)."""
    return {"output_tokens": m.total_completion_tokens, "duration_s": m.duration_s,
            "output_tok_per_s": m.output_token_throughput, "num_completed": m.num_completed,
            "num_errored": m.num_errored, "num_off_length": m.num_off_length,
            "ttft_median_ms_at_256_streams": m.ttft_ms.median, "ttft_ms_at_256_streams": dataclasses.asdict(m.ttft_ms),
            "tpot_median_ms_at_256_streams": m.tpot_ms.median}


async def _timed_run(client: Any, config: Any) -> tuple[Any, float, float, float]:
    """CONFIG's requests all at once: (loadgen's RateRun, its start and end on CLOCK_MONOTONIC, this process's
    CPU seconds meanwhile)."""
    from loadgen.cli import run_rate

    cpu, started = time.process_time(), time.perf_counter()
    run = await run_rate(client, config, 0, float("inf"))
    return run, started, time.perf_counter(), time.process_time() - cpu


async def _start_shards(base_url: str, model: str, vocab: int, prompts: list[list[int]], max_tokens: list[int],
                        scratch: Path, clients: int) -> tuple[list[Any], float]:
    """CLIENTS processes that send the requests all at once (request i from client i mod CLIENTS) from a common
    start: one client process streaming 512 requests was near a core busy (2x H200, two workers), so it could
    cap the figure. Returns them and the start (time.perf_counter: CLOCK_MONOTONIC, every process's clock)."""
    start_at = time.perf_counter() + 20.0  # NOTE: for the processes to start and warm their connections
    procs = []
    for k in range(clients):
        shard = scratch / f"shard{k}.jsonl"
        _config(base_url, model, vocab, prompts[k::clients], max_tokens[k::clients], shard)
        argv = [sys.executable, "-m", "bench.http_vs_offline", "--client-shard", str(shard), "--base-url", base_url,
                "--served-model", model, "--vocab", str(vocab), "--start-at", str(start_at)]
        procs.append(await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE))
    return procs, start_at


async def _shards_run(procs: list[Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """The figures over every shard's records once all have ended, and each client's CPU seconds."""
    printed = [(await proc.communicate())[0].decode() for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a client shard failed: exit codes {[proc.returncode for proc in procs]}")
    outs = [json.loads(text.strip().splitlines()[-1]) for text in printed]
    from loadgen.metrics import compute_metrics
    from loadgen.records import RequestRecord

    records = [RequestRecord(**r) for out in outs for r in out["records"]]
    metrics = compute_metrics(records, max(o["ended"] for o in outs) - min(o["started"] for o in outs))
    return _figures(metrics), {f"bench client {k}": o["cpu_s"] for k, o in enumerate(outs)}


async def _warm_up(client: Any, prompts: list[list[int]]) -> None:
    """The prompts at once, cut to 16 output tokens; their connections stay open for the timed run."""
    warm = await asyncio.gather(*(client.send(i, _request(p, 16), time.perf_counter()) for i, p in enumerate(prompts)))
    if not all(r.is_success for r in warm):
        raise RuntimeError(f"warm-up failed: {[r.error for r in warm if not r.is_success][:3]}")


WARM_LEAD_S = 10.0  # a client shard warms up this long before the common start: under aiohttp's 15 s keep-alive


def client_shard_main(args: argparse.Namespace) -> None:
    """One client process of _start_shards: its shard's requests cut short (its connections opened), then at
    once from args.start_at; prints its records."""
    from loadgen.cli import client_for

    rows = [json.loads(line) for line in args.client_shard.read_text().splitlines()]
    config = _config(args.base_url, args.served_model, args.vocab, [r["prompt"] for r in rows],
                     [r["max_tokens"] for r in rows], args.client_shard)

    async def run() -> dict[str, Any]:
        async with client_for(config) as client:
            # NOTE: its shard at once, cut short, as the one client's warm-up does: the timed run then streams over
            # connections already open (the two-worker runs' shards, started cold, saw TTFT medians of 0.5-1.0 s
            # at 256 streams a worker against 0.3 s with one warmed client). Warmed WARM_LEAD_S before the start:
            # aiohttp closes a connection idle 15 s, so shards that warmed up on starting opened new ones anyway.
            await asyncio.sleep(max(0.0, args.start_at - WARM_LEAD_S - time.perf_counter()))
            await _warm_up(client, [r["prompt"] for r in rows])
            if time.perf_counter() > args.start_at:
                raise RuntimeError("the shard's warm-up ran past the common start: give the shards more time")
            await asyncio.sleep(args.start_at - time.perf_counter())
            rate_run, started, ended, cpu = await _timed_run(client, config)
        # NOTE: the records' times count from the run's start (`started`, to well within a ms): on the shared clock
        records = [dataclasses.asdict(dataclasses.replace(
            r, send_time=r.send_time + started, end_time=r.end_time + started,
            chunk_times=[t + started for t in r.chunk_times])) for r in rate_run.records]
        return {"started": started, "ended": ended, "cpu_s": cpu, "records": records}

    print(json.dumps(asyncio.run(run())), flush=True)


async def http_part(base_url: str, model: str, vocab: int, prompts: list[list[int]], max_tokens: list[int],
                    ttft_prompts: list[list[int]], jsonl: Path, clients: int = 1) -> dict[str, Any]:
    from loadgen.cli import client_for

    config = _config(base_url, model, vocab, prompts, max_tokens, jsonl)
    async with client_for(config) as client:
        # The offline engine's warm-up, over HTTP: the whole workload at once, cut short. The first server
        # of a run compiles the Triton kernels its own shapes need (4 short requests as the warm-up left
        # the first variant at 77% of offline and the same server started again at 92%, on one H100).
        await _warm_up(client, prompts)
        if clients > 1:
            procs, start_at = await _start_shards(base_url, model, vocab, prompts, max_tokens, jsonl.parent, clients)
            await asyncio.sleep(max(0.0, start_at - 1.0 - time.perf_counter()))  # NOTE: the shards' warm-ups are over
        counts_before = await asyncio.to_thread(served_counts, base_url)
        if clients > 1:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        cpu_before, wall_before = ray_cpu_seconds(), time.perf_counter()
        if clients == 1:
            run, _, _, client_cpu = await _timed_run(client, config)
            figures, clients_cpu = _figures(run.metrics), {"bench client": client_cpu}
        else:
            figures, clients_cpu = await _shards_run(procs)
        cpu_after, wall = ray_cpu_seconds(), time.perf_counter() - wall_before
        busy = {f"{name} ({pid})": (cpu - cpu_before[pid][1]) / wall
                for pid, (name, cpu) in cpu_after.items() if pid in cpu_before and name != "bench client"}
        busy.update({name: cpu / wall for name, cpu in clients_cpu.items()})  # the clients measure their own
        # where a streamed token's CPU goes: each busy process's CPU over the run's output tokens
        tokens = max(1, figures["output_tokens"])
        us_per_token = {k: round(v * wall / tokens * 1e6, 1) for k, v in busy.items() if v >= 0.02}
        busy = dict(sorted(((k, round(v, 3)) for k, v in busy.items() if v >= 0.02), key=lambda kv: -kv[1]))
        # NOTE: the router replicas' summed counts (router/metrics_share.py) are each up to a second old
        await asyncio.sleep(1.5)
        counts_after = await asyncio.to_thread(served_counts, base_url)
        figures.update(_served_figures(counts_before, counts_after, wall))
        sum0, count0 = (counts_after.get(k, 0.0) for k in _SUMMED[:2])
        ttfts = []
        for i, p in enumerate(ttft_prompts):
            record = await client.send(10_000 + i, _request(p, 2), time.perf_counter())
            if not record.is_success:
                raise RuntimeError(f"TTFT probe failed: {record.error}")
            ttfts.append(record.ttft)
        await asyncio.sleep(1.5)
        counts_end = await asyncio.to_thread(served_counts, base_url)
        sum1, count1 = (counts_end.get(k, 0.0) for k in _SUMMED[:2])
    return {**figures, "clients": clients,
            "ttft_s": ttfts, "cpu_cores_busy_at_256_streams": busy, "cpu_us_per_token_at_256_streams": us_per_token,
            "router_ttft_mean_ms": (sum1 - sum0) / max(1.0, count1 - count0) * 1e3,
            "client_ttft_mean_ms": statistics.mean(ttfts) * 1e3}


def _request(prompt: list[int], max_tokens: int) -> Any:
    from loadgen.workloads import BenchRequest

    return BenchRequest(prompt=prompt, max_tokens=max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SHAPES / "qwen3-0.6b"))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--num-ttft", type=int, default=12)
    parser.add_argument("--ttft-len", type=int, default=512)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--clip", type=int, default=None, help="cut prompts and outputs to this many tokens (smoke)")
    parser.add_argument("--workers", type=int, default=1,
                        help="colocated workers (one GPU each) behind the endpoint; the HTTP run sends this many times "
                        "the offline workload (other prompts, drawn the same way) against one offline engine")
    parser.add_argument("--clients", type=int, default=None,
                        help="client processes sending the streams (default: --workers): one Python client near a "
                        "core busy would cap the served figure")
    parser.add_argument("--variants", default="r1,r2", help=f"comma-separated, of {sorted(VARIANTS)}")
    # one client process of --clients N (internal)
    parser.add_argument("--client-shard", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--served-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="where the results go (required unless --replot)")
    parser.add_argument("--replot", type=Path, default=None, help="redraw the PNG of this result JSON and exit")
    args = parser.parse_args()
    if args.client_shard is not None:
        client_shard_main(args)
        return
    if args.replot is not None:
        print(replot(args.replot))
        return
    if args.out is None:
        parser.error("--out is required (where the results go)")
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    dummy = args.model != "default"  # the shapes have no weights; the embedded default model has
    opts = argparse.Namespace(model=args.model, load_format="dummy" if dummy else "auto",
                              dtype="bfloat16" if dummy else "auto", device=args.device, seed=0, num_threads=None,
                              quick=False, out=args.out)
    engine = build_engine(opts, max_num_seqs=256, max_num_batched_tokens=16384)
    vocab = engine.arch.vocab_size

    def workload(num_seqs: int) -> tuple[list[list[int]], list[int]]:
        prompts, max_tokens = nano_vllm_workload(num_seqs, 0)
        return [[t % vocab for t in p][: args.clip] for p in prompts], [min(m, args.clip or m) for m in max_tokens]

    prompts, max_tokens = workload(args.num_seqs)
    # N workers: N times as many requests, drawn as nano-vllm draws them (its seed, a longer stream)
    http_prompts, http_max_tokens = (workload(args.num_seqs * args.workers) if args.workers > 1
                                     else (prompts, max_tokens))
    rng = random.Random(7)
    ttft_prompts = [[rng.randrange(vocab) for _ in range(args.ttft_len)] for _ in range(args.num_ttft + 2)]
    # others for the Ray-path probes: prompts the server has seen would hit its prefix cache
    ray_path_prompts = [[rng.randrange(vocab) for _ in range(args.ttft_len)] for _ in range(args.num_ttft + 2)]
    # Warm-up on the whole workload, cut short: a cold Triton cache compiles kernels during the first
    # pass over these prompt lengths (a first full run measured 12.6k tok/s against 18.7k after).
    run_engine(engine, prompts, [min(m, 16) for m in max_tokens])
    record: dict[str, Any] = {"ttft_len": args.ttft_len, "workers": args.workers,
                              "offline": run_engine(engine, prompts, max_tokens)}
    record["offline"]["ttft_s"] = offline_ttfts(engine, ttft_prompts)[2:]
    print("offline", {k: v for k, v in record["offline"].items() if k != "ttft_s"}, flush=True)
    env = environment(engine, opts)
    del engine
    free_device_memory()
    record["variants"] = {}
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        served = servable_model_dir(Path(args.model), Path(scratch)) if dummy else Path("default")
        flags = serve_flags({"model": str(served), "load_format": opts.load_format, "dtype": opts.dtype,
                             "device": args.device, "max_num_seqs": 256, "max_num_batched_tokens": 16384})
        for position, name in enumerate(names):
            extra_flags = VARIANTS[name]
            # a variant named again (ABBA orders) is recorded as name_2, name_3...
            key = name if names.index(name) == position else f"{name}_{names[:position + 1].count(name)}"
            port = free_port()  # the router replicas' own port
            argv = [sys.executable, "-m", "deploy.cli", "serve", "--colocated", "--decode", str(args.workers), *flags,
                    *extra_flags, "--port", str(port), "--grpc-port", str(free_port()), "--exit-after", "900",
                    # NOTE: the kernel spreads the streams over the replicas unevenly: any one may get all of them
                    "--max-in-flight", str(len(http_prompts))]
            server_env = {**os.environ, **NCCL_WORKER_ENV, "PYTHONUNBUFFERED": "1"}
            server = ServerProcess(argv, server_env, args.out / f"server_http_vs_offline_{key}.log")
            try:
                server.wait_ready(f"http://127.0.0.1:{port}/v1/models", 240)
                http = asyncio.run(http_part(f"http://127.0.0.1:{port}/v1", str(served), vocab, http_prompts,
                                             http_max_tokens, ttft_prompts, Path(scratch) / "w.jsonl",
                                             args.clients or args.workers))
                if position == 0:
                    http["ray_path"] = measure_server(server.log_path, ray_path_prompts, Path(scratch))
            finally:
                stop = server.stop(30)
                wait_gpus_free(30)
            http["server_stop"] = stop
            http["ttft_s"] = http["ttft_s"][2:]
            http["ttft_median_ms"] = statistics.median(http["ttft_s"]) * 1e3
            http["router_ttft_added_ms"] = http["ttft_median_ms"] - statistics.median(record["offline"]["ttft_s"]) * 1e3
            record["variants"][key] = http
            print(key, {k: v for k, v in http.items() if k != "ttft_s"}, flush=True)
    # The offline engine again, after the servers: this host's speed drifts between runs (H100
    # instances gave 11.9k-18.2k tok/s on this workload), so the baseline brackets the HTTP runs.
    engine = build_engine(opts, max_num_seqs=256, max_num_batched_tokens=16384)
    run_engine(engine, prompts, [min(m, 16) for m in max_tokens])
    record["offline_after"] = run_engine(engine, prompts, max_tokens)
    del engine
    free_device_memory()
    off = record["offline"]
    best_offline = max(off["output_tok_per_s"], record["offline_after"]["output_tok_per_s"])
    for http in record["variants"].values():
        http["http_over_best_offline_throughput"] = http["output_tok_per_s"] / best_offline
    record["ttft_median_offline_ms"] = statistics.median(off["ttft_s"]) * 1e3
    print({k: v for k, v in record.items() if k not in ("offline", "variants")}, flush=True)

    write_results(args.out, "http_vs_offline", env, record, lambda fig: plot(fig, record, args.ttft_len),
                  title(env))


def title(env: dict[str, Any]) -> str:
    return f"HTTP (Ray Serve router) vs offline engine, {env.get('device_name', env['device'])}"


def plot(fig: Any, record: dict[str, Any], ttft_len: int) -> None:
    """Throughput and lone-prompt TTFT: the offline engine before and after the servers, then each variant."""
    ax1, ax2 = fig.subplots(1, 2)
    variants = record["variants"]
    keys = list(variants)
    off, after = record["offline"], record["offline_after"]
    ax1.bar(["offline", *keys, "offline after"],
            [off["output_tok_per_s"], *(variants[k]["output_tok_per_s"] for k in keys), after["output_tok_per_s"]])
    for i, k in enumerate(keys, start=1):
        ax1.annotate(f"{variants[k]['http_over_best_offline_throughput']:.0%}", (i, variants[k]["output_tok_per_s"]),
                     ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("output tokens / s (256 streams); % of the better offline run")
    ax1.tick_params(axis="x", labelrotation=45)
    ax2.bar(["offline", *keys], [record["ttft_median_offline_ms"], *(variants[k]["ttft_median_ms"] for k in keys)])
    for i, k in enumerate(keys, start=1):
        ax2.annotate(f"+{variants[k]['router_ttft_added_ms']:.1f}", (i, variants[k]["ttft_median_ms"]),
                     ha="center", va="bottom", fontsize=8)
    ax2.tick_params(axis="x", labelrotation=45)
    ax2.set_ylabel(f"median TTFT, ms ({ttft_len}-token prompt, alone); + over offline")


def replot(json_path: Path) -> Path:
    """Redraws a result's PNG from its JSON (next to it)."""
    record = json.loads(json_path.read_text())
    png_path = json_path.with_suffix(".png")
    ttft_len = record.get("ttft_len", 512)  # results from before it was recorded all used the default, 512
    if not save_plot(png_path, lambda fig: plot(fig, record, ttft_len), title(record["environment"])):
        raise SystemExit("--replot needs matplotlib")
    return png_path

if __name__ == "__main__":
    main()
