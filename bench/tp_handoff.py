"""Rank 0's hand-off of a step to the other ranks of a tensor-parallel worker, two ways, one run:
a broadcast over the gloo host group (pickle, a 64 KiB header broadcast, a second one for the rest:
what pdserve did first, kept here as the baseline) against the shared-memory ring the product uses
(engine/parallel/ring.py through TPGroup.broadcast_object: pickle, then one copy into shared memory).

One follower process per extra rank; rank 0 sends decode-step messages (runner.ForwardStep of
`batch` sequences, each with the block table of a `context`-token sequence) one every --period-ms
(a step's period: latency, not throughput), stamped with time.perf_counter_ns (CLOCK_MONOTONIC,
comparable across processes); each follower records when it holds the decoded message. Reported:
median and p99 one-way latency, and rank 0's host time per send.

    python -m bench.tp_handoff --ranks 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT, save_plot
from engine.parallel.group import GroupAddress, TPGroup, host_store
from engine.runner import ForwardSeq, ForwardStep


def step_message(batch: int, context: int, block_size: int = 16) -> ForwardStep:
    n = context // block_size  # NOTE: a list per sequence, as in a real step (pickle would share one list)
    return ForwardStep([ForwardSeq([7], context - 1, list(range(i * n, (i + 1) * n)), 1) for i in range(batch)])


HEADER_BYTES = 1 << 16


_HEADERS: dict[int, torch.Tensor] = {}


def gloo_broadcast_object(group: TPGroup, obj: Any = None) -> Any:
    """The baseline: rank 0's pickled object over the host group, in a 64 KiB header broadcast (its
    first 8 bytes the length; one buffer per group, reused) and, when longer, a second broadcast of
    the rest."""
    import pickle

    import torch.distributed as dist

    header = _HEADERS.setdefault(id(group), torch.zeros(HEADER_BYTES, dtype=torch.uint8))
    options = dist.BroadcastOptions()
    options.rootRank = 0
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if group.rank == 0 else b""
    if group.rank == 0:
        head = min(len(payload), HEADER_BYTES - 8)
        header[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        header[8 : 8 + head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
    group.host_group.broadcast([header], options).wait()
    size = int(header[:8].view(torch.int64).item())
    head = min(size, HEADER_BYTES - 8)
    rest = torch.empty(max(size - head, 0), dtype=torch.uint8)
    if size > head:
        if group.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8))
        group.host_group.broadcast([rest], options).wait()
    if group.rank == 0:
        return obj
    return pickle.loads(header[8 : 8 + head].numpy().tobytes() + rest.numpy().tobytes())


def _follower(address: GroupAddress, rank: int, size: int, count: int, results: Any) -> None:
    group = TPGroup(address, rank, size, torch.device("cpu"))
    lat: dict[str, list[float]] = {"gloo": [], "ring": []}
    for way, receive in (("gloo", lambda: gloo_broadcast_object(group)), ("ring", group.broadcast_object)):
        for _ in range(count):
            sent, _msg = receive()
            lat[way].append((time.perf_counter_ns() - sent) / 1e3)
    results.put((rank, lat))
    group.close()


def measure(ranks: int, batch: int, context: int, count: int, period_s: float) -> dict[str, Any]:
    import pickle

    ctx = multiprocessing.get_context("spawn")
    store = host_store("127.0.0.1")
    address = GroupAddress("127.0.0.1", int(store.port))
    results = ctx.Queue()
    procs = [ctx.Process(target=_follower, args=(address, r, ranks, count, results)) for r in range(1, ranks)]
    for p in procs:
        p.start()
    group = TPGroup(address, 0, ranks, torch.device("cpu"), store=store)
    message = step_message(batch, context)
    send: dict[str, list[float]] = {"gloo": [], "ring": []}
    for way in ("gloo", "ring"):
        for _ in range(count):
            time.sleep(period_s)
            t = time.perf_counter_ns()
            if way == "gloo":
                gloo_broadcast_object(group, (t, message))
            else:
                group.broadcast_object((t, message))
            send[way].append((time.perf_counter_ns() - t) / 1e3)
        time.sleep(0.2)  # NOTE: the followers switch ways only after their last gloo message
    lat: dict[str, list[float]] = {"gloo": [], "ring": []}
    for _ in procs:
        _, got = results.get(timeout=60)
        for way in lat:
            lat[way].extend(got[way])
    for p in procs:
        p.join(10)
    group.close()
    size = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    row: dict[str, Any] = {"ranks": ranks, "batch": batch, "context": context, "message_bytes": size}
    for way in ("gloo", "ring"):
        values = sorted(lat[way][5:])  # NOTE: the first messages pay connection and page-fault costs
        row[way] = {"latency_us_median": statistics.median(values),
                    "latency_us_p99": values[int(0.99 * (len(values) - 1))],
                    "send_us_median": statistics.median(send[way][5:])}
    print(f"ranks {ranks} batch {batch:4d} ({size / 1e3:.1f} kB): gloo {row['gloo']['latency_us_median']:.0f} us "
          f"(p99 {row['gloo']['latency_us_p99']:.0f}), ring {row['ring']['latency_us_median']:.0f} us "
          f"(p99 {row['ring']['latency_us_p99']:.0f})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--period-ms", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    rows = [measure(r, b, args.context, args.count, args.period_ms / 1e3) for r in args.ranks for b in args.batches]
    import os
    import platform

    env = {"cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
           "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
           "torch": torch.__version__}
    out = args.out / "tp_handoff_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "tp_handoff", "environment": env, "period_ms": args.period_ms,
                               "count": args.count, "rows": rows}, indent=2) + "\n")

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        for ranks in args.ranks:
            sub = [r for r in rows if r["ranks"] == ranks]
            for way in ("gloo", "ring"):
                ax.plot([r["batch"] for r in sub], [r[way]["latency_us_median"] for r in sub], marker="o",
                        label=f"{way}, {ranks} ranks")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequences in the step message")
        ax.set_ylabel("one-way latency, median (us)")
        ax.legend()

    save_plot(out.with_suffix(".png"), plot, f"tp_handoff: gloo broadcast vs shared-memory ring, CPU "
              f"({env['num_cpus']} cores), period {args.period_ms} ms")


if __name__ == "__main__":
    main()
