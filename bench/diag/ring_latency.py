"""How late a follower takes rank 0's step message over the shared-memory ring (engine/parallel/ring.py), by
its spin window: a writer process sends a message every `--period-ms` (a decode step's length: rank 0 hands
off step N+1 about a step after step N), the reader (this process) records the time from the write to its
read of each. A reader whose spin window is shorter than the period has gone to sleep by the time the message
lands, and wakes at the end of one of its backoff sleeps; the GPU rank's window outlasts the step. CPU only:
two processes and a file in /dev/shm.

    python -m bench.diag.ring_latency --out DIR [--period-ms 2.7 18] [--messages 300]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import struct
import time
from pathlib import Path
from typing import Any

from engine.parallel import ring
from loadgen.metrics import percentile

_STAMP = struct.Struct("<d")


def _writer(names: Any, done: Any, period_s: float, messages: int) -> None:
    writer = ring.RingWriter(1)
    names.put((writer.name, os.getpid()))
    names.get(timeout=60)  # the reader is mapped and waiting
    due = time.perf_counter() + period_s
    for _ in range(messages):
        while time.perf_counter() < due:  # NOTE: spins to the due time: the writer's own lateness stays out
            pass
        writer.write(_STAMP.pack(time.perf_counter()))
        due += period_s
    done.get(timeout=120)
    writer.close()


def latencies_us(spin_s: float, period_s: float, messages: int) -> list[float]:
    """Write-to-read delay of each message, in microseconds (CLOCK_MONOTONIC is shared by the processes)."""
    ctx = multiprocessing.get_context("spawn")
    names, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer, args=(names, done, period_s, messages))
    proc.start()
    try:
        name, pid = names.get(timeout=60)
        reader = ring.RingReader(name, 1, 0, pid, spin_s=spin_s)
        names.put("ready")
        delays = []
        for _ in range(messages):
            payload = reader.read()
            delays.append((time.perf_counter() - _STAMP.unpack(payload)[0]) * 1e6)
        reader.close()
        done.put("done")
    finally:
        proc.join(timeout=120)
    return delays


def summary(delays: list[float]) -> dict[str, float]:
    return {"median_us": percentile(delays, 50), "p90_us": percentile(delays, 90), "p99_us": percentile(delays, 99),
            "max_us": max(delays), "mean_us": statistics.fmean(delays)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--period-ms", type=float, nargs="+", default=[2.7, 18.0])
    parser.add_argument("--messages", type=int, default=300)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for period_ms in args.period_ms:
        for label, spin_s in (("cpu_rank_spin", ring.SPIN_S), ("gpu_rank_spin", ring.GPU_SPIN_S),
                              ("cpu_rank_spin_again", ring.SPIN_S), ("gpu_rank_spin_again", ring.GPU_SPIN_S)):
            delays = latencies_us(spin_s, period_ms / 1e3, args.messages)[10:]  # the first ones warm up
            key = f"period_{period_ms}ms_{label}"
            results[key] = {"period_ms": period_ms, "spin_s": spin_s, **summary(delays)}
            print(key, {k: round(v, 4 if k == "spin_s" else 1) for k, v in results[key].items()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "ring_latency", "device_name": "cpu", "host": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "messages": args.messages, "results": results}
    (out / "ring_latency_cpu.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
