"""Soak: requests arrive faster than the cluster can serve them, for a bounded time; nothing may
leak, crash or go unanswered.

Setup: a prefill and a decode worker (or one colocated worker), in this process over the local
transport (`--workers inprocess`, the default) or as Ray actors over gloo (`--workers ray`), behind a
Dispatcher and a RouterCore with a bounded in-flight limit (`--max-in-flight`), so overload answers
429 (router full) or 503 (no KV blocks), never a growing queue.

1. Calibrate: `--max-in-flight` closed-loop clients for `--calibrate-s`: completed requests/s is the
   capacity.
2. Soak: Poisson arrivals at `--rate` requests/s (default `--overload` x capacity) for
   `--duration-s` (180 s; 20 s with --quick). Prompts are random token ids (4 to `--max-prompt-len`),
   greedy, `--max-tokens` each (ignore_eos). Every `--sample-s`: the RSS of every process serving
   (this one, and the Ray workers), requests in flight, and the running counts.
3. Drain: stop sending, wait for every request's answer (each bounded by `--request-timeout-s`).

Checked and recorded: every request answered (none still running or timed out: then sent = completed +
rejected + errored), the overload met by refusals (some 429/503), no KV block held on any worker
(check_integrity), and
memory flat: the RSS slope (MB/min, least squares) and growth (mean of the last quarter minus the
first quarter) after the first 20% of the soak (warm-up: allocator and caches filling).

    .venv/bin/python -m bench.soak [--quick] [--duration-s 180] [--workers inprocess|ray] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.common import base_parser, build_engine, environment, title, write_results
from engine import EngineConfig, SamplingParams, engine_config
from engine.tokenizer import Tokenizer
from router import Dispatcher, RouterConfig, RouterCore, Workers
from router.dispatch import DispatcherConfig
from router.openai_schema import APIError

@dataclass
class Counts:
    sent: int = 0
    completed: int = 0
    rejected: int = 0  # 429 (router full) or 503 (no KV blocks): overload answered as it should be
    errored: int = 0  # any other error answer
    unanswered: int = 0  # still running after --request-timeout-s: must stay 0
    statuses: dict[str, int] = field(default_factory=dict)  # "429", "503", "500", ... -> count
    completed_tokens: int = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.completed - self.rejected - self.errored - self.unanswered


@dataclass
class Sample:
    t_s: float  # since the soak started
    rss_mb: dict[str, float]  # process label -> resident set size
    in_flight: int
    sent: int
    completed: int
    rejected: int
    errored: int


class Cluster:
    """The workers, in this process or on Ray, behind one Dispatcher and RouterCore."""

    def __init__(self, args: argparse.Namespace, engine: EngineConfig) -> None:
        self.args = args
        self.engine = engine
        self.local: list[Any] = []  # in-process worker objects
        self.deployment: Any = None
        self.pids: dict[str, int] = {"driver": os.getpid()}

    async def start(self) -> Workers:
        if self.args.workers == "ray":
            return await self._start_ray()
        from decode_worker import DecodeWorker, DecodeWorkerConfig
        from kvtransfer import LocalHub
        from prefill_worker import PrefillWorker, PrefillWorkerConfig

        options = {"hub": LocalHub()}
        decode_id = "colocated-0" if self.args.mode == "colocated" else "decode-0"
        decode = DecodeWorker(DecodeWorkerConfig(worker_id=decode_id, engine=self.engine, transport="local"),
                              transport_options=options)
        self.local = [decode]
        if self.args.mode == "colocated":
            return Workers.of(prefill={}, decode={decode_id: decode})
        prefill = PrefillWorker(PrefillWorkerConfig(worker_id="prefill-0", engine=self.engine, transport="local"),
                                transport_options=options)
        self.local.append(prefill)
        return Workers.of(prefill={"prefill-0": prefill}, decode={"decode-0": decode})

    async def _start_ray(self) -> Workers:
        import ray

        from cluster.config import ClusterConfig
        from cluster.deployment import Deployment

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}})
        config = ClusterConfig(engine=self.engine, mode=self.args.mode, num_prefill=1, num_decode=1, transport="gloo")
        self.deployment = Deployment(config)
        await self.deployment.start()
        for pool in self.deployment.pools:
            for worker_id, handle in pool.handles.items():
                self.pids[worker_id] = (await handle.stats.remote()).pid
        return self.deployment.workers()

    async def held_blocks(self) -> dict[str, int]:
        if self.deployment is not None:
            return await self.deployment.held_blocks()
        return {w.worker_id: await w.check_integrity() for w in self.local}

    async def stop(self) -> None:
        for worker in self.local:
            await worker.shutdown()
        if self.deployment is not None:
            import ray

            self.deployment.shutdown()
            ray.shutdown()


def rss_mb(pid: int) -> float:
    """Resident set size of a process from /proc (Linux); 0.0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class Load:
    def __init__(self, core: RouterCore, args: argparse.Namespace, seed: int) -> None:
        self.core = core
        self.args = args
        self.rng = random.Random(seed)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.counts = Counts()
        self.tasks: set[asyncio.Task[None]] = set()
        self._ids = 0

    def prompt(self) -> list[int]:
        return [self.rng.randrange(4, 2048) for _ in range(self.rng.randint(4, self.args.max_prompt_len))]

    async def one(self) -> None:
        self._ids += 1
        self.counts.sent += 1
        outcome, status = "errored", "500"
        try:
            outcome, status = await asyncio.wait_for(self._request(f"soak-{self._ids}"), self.args.request_timeout_s)
        except asyncio.TimeoutError:
            outcome, status = "unanswered", "timeout"
        except Exception as err:  # noqa: BLE001 - counted as an error answer
            status = type(err).__name__
        setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        self.counts.statuses[status] = self.counts.statuses.get(status, 0) + 1

    async def _request(self, request_id: str) -> tuple[str, str]:
        try:
            num_tokens = 0
            async for delta in self.core.generate(request_id, self.prompt(), self.params):
                num_tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    self.counts.completed_tokens += num_tokens
                    return "completed", "200"
            return "errored", "no finish_reason"
        except APIError as err:
            return ("rejected" if err.status_code in (429, 503) else "errored"), str(err.status_code)

    def spawn(self) -> None:
        task = asyncio.get_running_loop().create_task(self.one())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def closed_loop(self, num_clients: int, duration_s: float) -> float:
        """Completed requests per second with `num_clients` clients sending one after another."""
        deadline = time.monotonic() + duration_s
        before = self.counts.completed
        started = time.monotonic()

        async def client() -> None:
            while time.monotonic() < deadline:
                await self.one()

        await asyncio.gather(*(client() for _ in range(num_clients)))
        return (self.counts.completed - before) / (time.monotonic() - started)

    async def open_loop(self, rate: float, duration_s: float, on_tick: Any) -> None:
        """Poisson arrivals at `rate`/s for `duration_s`; `on_tick(t)` every --sample-s."""
        started = time.monotonic()
        next_arrival = started
        next_sample = started
        while (now := time.monotonic()) - started < duration_s:
            if now >= next_sample:
                on_tick(now - started)
                next_sample += self.args.sample_s
            while next_arrival <= now:
                self.spawn()
                next_arrival += self.rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(next_arrival, next_sample) - time.monotonic()))

    async def drain(self, on_tick: Any, started: float) -> None:
        while self.tasks:
            on_tick(time.monotonic() - started)
            await asyncio.wait(set(self.tasks), timeout=self.args.sample_s)


def memory_trend(samples: list[Sample], warmup_fraction: float = 0.2) -> dict[str, Any]:
    """Per process and in total, after the warm-up: RSS slope (MB/min, least squares) and growth
    (mean of the last quarter minus the first quarter), with the min and max."""
    kept = samples[int(len(samples) * warmup_fraction):]
    if len(kept) < 4:
        return {}
    out: dict[str, Any] = {}
    for label in [*kept[0].rss_mb, "total"]:
        ys = [sum(s.rss_mb.values()) if label == "total" else s.rss_mb.get(label, 0.0) for s in kept]
        xs = [s.t_s / 60.0 for s in kept]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs) or 1e-9
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
        q = max(1, len(ys) // 4)
        out[label] = {
            "slope_mb_per_min": round(slope, 3),
            "growth_mb": round(sum(ys[-q:]) / q - sum(ys[:q]) / q, 2),
            "min_mb": round(min(ys), 1),
            "max_mb": round(max(ys), 1),
        }
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_config(args.model, device=args.device, load_format=args.load_format, dtype=args.dtype,
                           seed=args.seed, block_size=args.block_size, num_blocks=args.num_blocks)
    cluster = Cluster(args, engine)
    workers = await cluster.start()
    local = build_engine(args, block_size=args.block_size, num_blocks=args.num_blocks)  # model facts, env
    dispatcher = Dispatcher("soak", workers, poll_timeout_s=0.2, config=DispatcherConfig(max_capacity_wait_s=1.0))
    core = RouterCore(dispatcher, Tokenizer.from_dir(local.model_dir), RouterConfig(max_in_flight=args.max_in_flight),
                      local.max_model_len)
    try:
        calibration = Load(core, args, args.seed + 1)
        capacity = await calibration.closed_loop(args.max_in_flight, args.calibrate_s)
        rate = args.rate if args.rate is not None else args.overload * capacity
        print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {args.duration_s:.0f} s")

        load = Load(core, args, args.seed)
        samples: list[Sample] = []

        def tick(t_s: float) -> None:
            c = load.counts
            rss = {label: rss_mb(pid) for label, pid in cluster.pids.items()}
            samples.append(Sample(round(t_s, 2), rss, c.in_flight, c.sent, c.completed, c.rejected, c.errored))

        started = time.monotonic()
        await load.open_loop(rate, args.duration_s, tick)
        await load.drain(tick, started)
        tick(time.monotonic() - started)
        soak_s = time.monotonic() - started
        await asyncio.sleep(0.5)  # the last aborts and token batches land
        held = await cluster.held_blocks()
    finally:
        await dispatcher.close()
        await cluster.stop()

    c = load.counts
    checks = {
        # NOTE: with none in flight or unanswered, sent = completed + rejected + errored holds by the counts' making
        "every_request_answered": c.unanswered == 0 and c.in_flight == 0,
        "no_block_held": set(held.values()) == {0},
        # past capacity, measured rather than set: the router refused some (429/503), as overload should be met
        "overload_answered": c.rejected > 0,
    }
    trend = memory_trend(samples)
    return {
        "workload": {
            "workers": args.workers, "mode": args.mode, "duration_s": args.duration_s, "rate_per_s": round(rate, 3),
            "overload": args.overload if args.rate is None else None, "max_in_flight": args.max_in_flight,
            "max_tokens": args.max_tokens, "max_prompt_len": args.max_prompt_len,
            "kv_cache": {"num_blocks": args.num_blocks, "block_size": args.block_size},
        },
        "capacity_per_s": round(capacity, 3),
        "soak_s": round(soak_s, 2),
        "counts": {**asdict(c), "in_flight": c.in_flight},
        "completed_per_s": round(c.completed / soak_s, 3),
        "output_tokens_per_s": round(c.completed_tokens / soak_s, 1),
        "held_blocks_after_drain": held,
        "memory": trend,
        "checks": checks,
        "samples": [asdict(s) for s in samples],
        "_env_engine": local,
    }


def plot(record: dict[str, Any]) -> Any:
    samples = record["samples"]

    def draw(fig: Any) -> None:
        ts = [s["t_s"] for s in samples]
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        labels = list(samples[0]["rss_mb"]) if samples else []
        for label in labels:
            ax1.plot(ts, [s["rss_mb"].get(label, 0.0) for s in samples], label=label)
        ax1.set_xlabel("time (s)")
        ax1.set_ylabel("RSS (MB)")
        ax1.set_title("resident memory of each serving process")
        top = max((v for s in samples for v in s["rss_mb"].values()), default=1.0)
        ax1.set_ylim(0, 1.15 * top)
        ax1.legend(fontsize=8)
        for key in ("sent", "completed", "rejected", "errored"):
            ax2.plot(ts, [s[key] for s in samples], label=key)
        ax2.plot(ts, [s["in_flight"] for s in samples], label="in flight", linestyle="--")
        ax2.set_xlabel("time (s)")
        ax2.set_ylabel("requests (cumulative; in flight: now)")
        ax2.set_title("requests")
        ax2.legend(fontsize=8)

    return draw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=None, help="Soak length (default 180; 20 with --quick).")
    parser.add_argument("--workers", choices=["inprocess", "ray"], default="inprocess")
    parser.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    parser.add_argument("--rate", type=float, default=None, help="Requests/s; default --overload x capacity.")
    parser.add_argument("--overload", type=float, default=2.0, help="Rate over the calibrated capacity.")
    parser.add_argument("--calibrate-s", type=float, default=None, help="Calibration length (10 s; 4 with --quick).")
    parser.add_argument("--max-in-flight", type=int, default=32, help="The router's limit; beyond it: 429.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=1.0, help="Seconds between memory samples.")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="A request unanswered by then fails.")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cpu" if not torch.cuda.is_available() else "cuda"
    if args.duration_s is None:
        args.duration_s = 20.0 if args.quick else 180.0
    if args.calibrate_s is None:
        args.calibrate_s = 4.0 if args.quick else 10.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    record = asyncio.run(run(args))
    local = record.pop("_env_engine")
    env = environment(local, args)
    c, w = record["counts"], record["workload"]
    line = (f"{w['workers']} {w['mode']}: {w['rate_per_s']} req/s for {w['duration_s']:.0f} s (capacity "
            f"{record['capacity_per_s']} req/s); sent {c['sent']} = completed {c['completed']} + rejected "
            f"{c['rejected']} + errored {c['errored']}")
    plot_title = title("Soak past capacity", env, line)
    json_path, png_path = write_results(args.out, "soak", env, record, plot(record), plot_title)
    print(line)
    print(f"memory after warm-up: {record['memory'].get('total')}; checks: {record['checks']}")
    print(f"wrote {json_path} and {png_path}")
    if not all(record["checks"].values()):
        raise SystemExit(f"soak checks failed: {record['checks']}")
    return {"json": str(json_path), "png": str(png_path), "record": record}


if __name__ == "__main__":
    main()
