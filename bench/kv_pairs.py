"""KV-transfer bandwidth when several pairs move data at once, on one machine with G GPUs (G = 2, 4, 8).

G workers w0..w{G-1}, one bench.raw_peers.RawPeer each (pdserve's own transport, nothing on top),
each on its own GPU (num_gpus=1); `s->r` means s sends to r:

  topology  pairs                       G=4            G=8
  single    w0->w1                      1 pair         1 pair     (the baseline, always measured)
  disjoint  w0->w1, w2->w3, ...         2 pairs        4 pairs    (no worker in two pairs)
  fan-in    w1..wK -> w0                3->1           7->1       (K prefill GPUs into one decode GPU)
  fan-out   w0 -> w1..wK                1->3           1->7       (one prefill GPU to K decode GPUs)

K is --fan-width (default G-1). Each unordered pair of workers is formed once (one communicator)
and serves every topology it appears in.

For one topology and one message size, every worker in it is told one start instant and, from
there, runs --iters iterations (after --warmup untimed ones) of: start all its transfers at once
(one per pair it is in, each pair on its own stream), poll until all have finished. It records each
iteration's start and each transfer's end on time.monotonic(), one clock for every process of the
host. Reported:

  per pair    size / median over iterations of (later end - later start of its two sides): a
              transfer cannot begin before both sides posted it, nor has it ended before both saw it end
  aggregate   every byte every pair moved / (last end - first begin over all pairs): the machine's
              throughput, host overheads between iterations included
  sum_of_pairs  the sum of the per-pair medians (what the pairs reach while they all overlap)
  single-pair baseline of the same run and the same method, and bench.disagg's sender-timed raw
  figure on w0->w1 (bench.raw_peers.pair_bandwidth) as a cross-check with disagg_*.json.

NOTE: times are taken on the host around pdserve's transport calls, so they include its per-op host
cost (tens of us: issuing the op, the stream wait, the event); that weighs on 16 MiB (about 50 us
over NVLink at 350 GB/s) and hardly on 256 MiB. The baseline pays the same cost.

GB/s are 1e9 bytes/s. Writes kv_pairs_<device slug>.json (bench.common.write_results; the 4- and
8-GPU runs of one GPU kind get the same name: give them separate --out folders), and the PNG where
matplotlib is installed (not on the GPU machines: redraw it later with --plot-from JSON).

GPU machine (4 or 8 GPUs, carry [".raybundle"]; expected 1-2 minutes, not yet run there):

    bash -c 'tar -xJf .raybundle/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 && timeout 300 python3 -m bench.kv_pairs --out $OUT'

CPU smoke run (gloo over loopback; figures say nothing about GPUs):

    GLOO_SOCKET_IFNAME=lo python -m bench.kv_pairs --device cpu --transport gloo --num-workers 4 \\
        --sizes-mib 1,4 --iters 10 --warmup 2 --num-cpus 2 --out /tmp/kv_pairs

Knows nothing of engines, KV blocks or leases: it moves raw buffers between raw peers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray
import torch

from bench.common import DEFAULT_OUT, device_name, save_plot, write_results
from bench.raw_peers import RawPeer, form_pair, pair_bandwidth
from kvtransfer import NCCL_WORKER_ENV

TOPOLOGIES = ("single", "disjoint", "fan-in", "fan-out")
START_TIMEOUT_S = 180.0  # every actor up: Ray worker, torch import, CUDA context
PAIR_TIMEOUT_S = 60.0
LEAD_S = 0.5  # from telling the workers the start instant to that instant: covers Ray's call latency

Pair = tuple[int, int]  # (sender worker index, receiver worker index)


# ---- topologies and the arithmetic (pure: no Ray, no devices)
def topology_pairs(name: str, num_workers: int, fan_width: int | None = None) -> list[Pair]:
    """The (sender, receiver) worker indices of topology `name` on `num_workers` workers."""
    if num_workers < 2:
        raise ValueError(f"num_workers must be at least 2 (one pair), got {num_workers}")
    width = num_workers - 1 if fan_width is None else fan_width
    if name in ("fan-in", "fan-out") and not 1 <= width <= num_workers - 1:
        raise ValueError(f"fan_width must be between 1 and num_workers - 1 = {num_workers - 1}, got {width}")
    if name == "single":
        return [(0, 1)]
    if name == "disjoint":
        return [(i, i + 1) for i in range(0, num_workers - 1, 2)]
    if name == "fan-in":
        return [(i, 0) for i in range(1, width + 1)]
    if name == "fan-out":
        return [(0, i) for i in range(1, width + 1)]
    raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")


def worker_ops(pairs: list[Pair]) -> dict[int, list[tuple[int, str]]]:
    """Per worker index, its transfers in pair order: (peer index, "send" or "recv")."""
    ops: dict[int, list[tuple[int, str]]] = {}
    for sender, receiver in pairs:
        if sender == receiver:
            raise ValueError(f"a worker cannot send to itself: pair {(sender, receiver)}")
        ops.setdefault(sender, []).append((receiver, "send"))
        ops.setdefault(receiver, []).append((sender, "recv"))
    return ops


def transfer_spans(pairs: list[Pair], rows: dict[int, list[list[float]]]) -> list[list[tuple[float, float]]]:
    """Per pair, per iteration: (begin, end) of the transfer = (later start, later end) of its two sides.

    rows[w] is worker w's RawPeer.run result for worker_ops(pairs)[w]: per iteration
    [start, end of op 0, end of op 1, ...]."""
    ops = worker_ops(pairs)
    spans = []
    for sender, receiver in pairs:
        col_s = 1 + ops[sender].index((receiver, "send"))
        col_r = 1 + ops[receiver].index((sender, "recv"))
        if len(rows[sender]) != len(rows[receiver]):
            raise ValueError(f"w{sender} ran {len(rows[sender])} iterations, w{receiver} {len(rows[receiver])}")
        spans.append([(max(s[0], r[0]), max(s[col_s], r[col_r])) for s, r in zip(rows[sender], rows[receiver])])
    return spans


def bandwidth(num_bytes: int, spans: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """Per-pair median GB/s (and 10th/90th percentiles), their sum, and the aggregate GB/s: every
    byte moved / (first begin to last end over all pairs)."""
    per_pair, p10, p90 = [], [], []
    for pair_spans in spans:
        gbps = sorted(num_bytes / (end - begin) / 1e9 for begin, end in pair_spans)
        per_pair.append(num_bytes / statistics.median(end - begin for begin, end in pair_spans) / 1e9)
        p10.append(_nearest_rank(gbps, 0.1))
        p90.append(_nearest_rank(gbps, 0.9))
    first = min(begin for pair_spans in spans for begin, _ in pair_spans)
    last = max(end for pair_spans in spans for _, end in pair_spans)
    num_moved = num_bytes * sum(len(pair_spans) for pair_spans in spans)
    return {
        "per_pair_median_gbps": per_pair,
        "per_pair_p10_gbps": p10,
        "per_pair_p90_gbps": p90,
        "sum_of_pairs_gbps": sum(per_pair),
        "aggregate_gbps": num_moved / (last - first) / 1e9,
        "span_s": last - first,
        "bytes_moved": num_moved,
    }


def _nearest_rank(ascending: list[float], q: float) -> float:
    return ascending[round(q * (len(ascending) - 1))]


# ---- the run
class Workers:
    """The G RawPeers and the pairs formed among them."""

    def __init__(self, num_workers: int, transport: str, device: str) -> None:
        gpus = 1 if device != "cpu" else 0
        self.ids = [f"w{i}" for i in range(num_workers)]
        self.actors = [RawPeer.options(num_gpus=gpus).remote(w, transport, device) for w in self.ids]
        self.gpu_ids = ray.get([a.gpu_ids.remote() for a in self.actors], timeout=START_TIMEOUT_S)
        self.formed: set[tuple[int, int]] = set()
        self.poll_s = 0.0 if device != "cpu" else 1e-4  # CPU: leave the cores to gloo's threads

    def form(self, pairs: list[Pair]) -> None:
        """Form every pair not formed yet, one after another; the lower index hosts the rendezvous."""
        for a, b in pairs:
            low, high = min(a, b), max(a, b)
            if (low, high) not in self.formed:
                form_pair(self.actors[low], self.ids[low], self.actors[high], self.ids[high], PAIR_TIMEOUT_S)
                self.formed.add((low, high))

    def alloc(self, num_bytes: int) -> None:
        """Every worker: one buffer of `num_bytes` per worker it is paired with."""
        peers: dict[int, list[str]] = {i: [] for i in range(len(self.ids))}
        for a, b in sorted(self.formed):
            peers[a].append(self.ids[b])
            peers[b].append(self.ids[a])
        ray.get([self.actors[i].alloc.remote(num_bytes, p) for i, p in peers.items()], timeout=PAIR_TIMEOUT_S)

    def run(self, pairs: list[Pair], num_iters: int, timeout_s: float) -> dict[int, list[list[float]]]:
        """Every worker of `pairs` runs its transfers `num_iters` times from one start instant."""
        ops = worker_ops(pairs)
        start_at = time.monotonic() + LEAD_S
        refs = {w: self.actors[w].run.remote([(self.ids[p], op) for p, op in o], num_iters, start_at, timeout_s,
                                              self.poll_s)
                for w, o in ops.items()}
        rows = ray.get(list(refs.values()), timeout=LEAD_S + timeout_s + 10)
        return dict(zip(refs, rows))

    def close(self, is_clean: bool) -> None:
        """Close the transports (only after a clean run: a worker stuck in a transfer would not get
        to it), then kill the actors."""
        if is_clean:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        for actor in self.actors:
            ray.kill(actor)


def measure(workers: Workers, topologies: dict[str, list[Pair]], sizes: list[int], args: argparse.Namespace,
            record: dict[str, Any]) -> None:
    """Fills record["results"][topology][size] (and "error" on the first failure, after which the
    devices may be stuck, so nothing more is measured)."""
    results = record["results"]
    for size in sizes:
        workers.alloc(size)
        for name, pairs in topologies.items():
            try:
                workers.run(pairs, args.warmup, args.timeout_s)
                rows = workers.run(pairs, args.iters, args.timeout_s)
            except Exception as e:  # noqa: BLE001 - reported in the JSON; the run stops here
                record["error"] = f"{name}, {size} bytes: {type(e).__name__}: {e}"
                print(record["error"], flush=True)
                return
            firsts = [r[0][0] for r in rows.values()]
            entry = {"pairs": [{"sender": f"w{s}", "receiver": f"w{r}", "sender_gpu": workers.gpu_ids[s],
                                "receiver_gpu": workers.gpu_ids[r]} for s, r in pairs],
                     **bandwidth(size, transfer_spans(pairs, rows)),
                     "start_skew_s": max(firsts) - min(firsts)}
            results.setdefault(name, {})[str(size)] = entry
            base = results["single"][str(size)]["per_pair_median_gbps"][0]
            print(f"{name:9s} {size >> 20:5d} MiB  {len(pairs)} pairs  per pair (median) "
                  f"{statistics.median(entry['per_pair_median_gbps']):7.1f} GB/s "
                  f"[{min(entry['per_pair_median_gbps']):.1f}-{max(entry['per_pair_median_gbps']):.1f}]  "
                  f"aggregate {entry['aggregate_gbps']:7.1f} GB/s  single pair {base:7.1f} GB/s", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="disjoint,fan-in,fan-out",
                        help=f"comma-separated, of {', '.join(TOPOLOGIES[1:])}; 'single' is always measured")
    parser.add_argument("--sizes-mib", default="16,256", help="message sizes, MiB, comma-separated")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per topology and size")
    parser.add_argument("--warmup", type=int, default=10, help="untimed iterations before them")
    parser.add_argument("--num-workers", type=int, default=None, help="G: workers, one per GPU (default: all GPUs)")
    parser.add_argument("--fan-width", type=int, default=None, help="K of fan-in K->1 and fan-out 1->K (default G-1)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="'cpu' (gloo) for a smoke run")
    parser.add_argument("--transport", default=None, help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--num-cpus", type=int, default=None, help="ray.init(num_cpus=...); default Ray's own")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="longest one timed loop of one worker may take")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot-from", type=Path, default=None, help="only redraw the PNG of this JSON beside it")
    args = parser.parse_args(argv)
    if args.plot_from is not None:
        record = json.loads(args.plot_from.read_text())
        save_plot(args.plot_from.with_suffix(".png"), lambda fig: plot(fig, record), plot_title(record))
        return record
    transport = args.transport or ("nccl" if args.device == "cuda" else "gloo")
    num_workers = args.num_workers or (torch.cuda.device_count() if args.device == "cuda" else 4)
    sizes = [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    names = ["single", *(t for t in args.topologies.split(",") if t and t != "single")]
    topologies = {name: topology_pairs(name, num_workers, args.fan_width) for name in names}  # raises on bad flags
    for flag, value in (("--iters", args.iters), ("--warmup", args.warmup)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")

    # NOTE: address="local": always a new cluster of this machine, never one another job left running
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": dict(NCCL_WORKER_ENV)})
    if args.device == "cuda" and ray.cluster_resources().get("GPU", 0) < num_workers:
        raise ValueError(f"--num-workers {num_workers} needs as many GPUs; Ray sees "
                         f"{ray.cluster_resources().get('GPU', 0)}")
    record: dict[str, Any] = {"workload": {"num_workers": num_workers, "transport": transport, "sizes": sizes,
                                           "iters": args.iters, "warmup": args.warmup,
                                           "topologies": {n: [f"w{s}->w{r}" for s, r in p]
                                                          for n, p in topologies.items()}},
                              "results": {}}
    started = time.monotonic()
    workers: Workers | None = None
    try:
        workers = Workers(num_workers, transport, args.device)
        record["workload"]["worker_gpus"] = workers.gpu_ids
        record["start_s"] = time.monotonic() - started
        workers.form([p for pairs in topologies.values() for p in pairs])
        record["pairing_s"] = time.monotonic() - started - record["start_s"]
        print(f"{num_workers} workers up in {record['start_s']:.1f} s (GPUs {workers.gpu_ids}), "
              f"{len(workers.formed)} pairs formed in {record['pairing_s']:.1f} s", flush=True)
        measure(workers, topologies, sizes, args, record)
        if "error" not in record:  # bench.disagg's method on w0->w1, for comparison with disagg_*.json
            sender_timed = pair_bandwidth(workers.actors[0], "w0", workers.actors[1], "w1", sizes, args.iters,
                                          args.timeout_s)
            record["single_pair_sender_timed_gbps"] = {str(k): v for k, v in sender_timed.items()}
            print("w0->w1 timed on the sender (bench.disagg's method):",
                  {f"{k >> 20} MiB": round(v, 1) for k, v in sender_timed.items()}, flush=True)
    except Exception as e:  # noqa: BLE001 - written into the JSON with what was measured before it
        record["error"] = f"{type(e).__name__}: {e}"
        print(record["error"], flush=True)
    finally:
        if workers is not None:
            workers.close(is_clean="error" not in record)
        record["wall_s"] = time.monotonic() - started
        ray.shutdown()
    env = environment(args.device, num_workers, transport)
    json_path, png_path = write_results(args.out, "kv_pairs", env, record, lambda fig: plot(fig, record),
                                        plot_title({"environment": env, **record}))
    print(f"wrote {json_path}", flush=True)
    return {"json": str(json_path), "png": str(png_path), **record}


def environment(device: str, num_workers: int, transport: str) -> dict[str, Any]:
    return {
        "device": device,
        "device_name": device_name(torch.device(device)),
        "num_gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "num_workers": num_workers,
        "transport": transport,
        "num_cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_version": torch.__version__,
        "ray_version": ray.__version__,
        "python_version": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "worker_env": dict(NCCL_WORKER_ENV),  # every actor's runtime_env
    }


def plot_title(doc: dict[str, Any]) -> str:
    env, work = doc["environment"], doc["workload"]
    smoke = "  [CPU SMOKE RUN: says nothing about GPUs]" if env["device"] == "cpu" else ""
    return (f"KV transfer with several pairs at once, {work['transport']} (pdserve transport, raw buffers){smoke}\n"
            f"{work['num_workers']} x {env['device_name']}, torch {env['torch_version']}, {env['date']}\n"
            f"{work['iters']} timed iterations per topology and size; per pair: size / median transfer time")


def plot(fig: Any, record: dict[str, Any]) -> None:
    results = record["results"]
    sizes = [str(s) for s in record["workload"]["sizes"] if str(s) in results.get("single", {})]
    axes = fig.subplots(1, max(1, len(sizes)), squeeze=False)[0]
    for ax, size in zip(axes, sizes):
        names = [n for n in results if size in results[n]]
        entries = [results[n][size] for n in names]
        per_pair = [statistics.median(e["per_pair_median_gbps"]) for e in entries]
        low = [p - min(e["per_pair_median_gbps"]) for p, e in zip(per_pair, entries)]
        high = [max(e["per_pair_median_gbps"]) - p for p, e in zip(per_pair, entries)]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], per_pair, width=0.4, yerr=[low, high], capsize=3,
               label="per pair (median of pairs; bars: min-max)")
        bars = ax.bar([i + 0.2 for i in x], [e["aggregate_gbps"] for e in entries], width=0.4, label="aggregate")
        for bar, e in zip(bars, entries):
            ax.annotate(f"{e['aggregate_gbps']:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.axhline(results["single"][size]["per_pair_median_gbps"][0], color="gray", linestyle="--",
                   label="single pair, same run")
        ax.set_xticks(list(x), [f"{n}\n{len(results[n][size]['pairs'])} pairs" for n in names])
        ax.set_title(f"{int(size) / (1 << 20):g} MiB messages")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
