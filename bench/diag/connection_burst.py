"""Does a burst over new connections cost a served request seconds? In issue 29's two-worker runs the
clients' TTFT reached p99 1.3-1.7 s while the routers' own TTFT (admitted -> first token) averaged
52-109 ms, and their streams rode new connections. This sends --requests one-token completions at once to
`pdserve serve` (--replicas router replicas on one port), first each over a new connection, then over
connections a burst before left open, and reports each burst's latencies and the kernel's counts of
refused or dropped connections over it (`nstat`: a full accept queue drops a SYN, which the client
resends after a second).

    python -m bench.diag.connection_burst [--requests 512] [--replicas 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COUNTERS = ("TcpExtListenOverflows", "TcpExtListenDrops", "TcpExtTCPReqQFullDrop")


def kernel_counts() -> dict[str, int]:
    out = subprocess.run(["nstat", "-az", *COUNTERS], capture_output=True, text=True, check=True).stdout
    return {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if line.startswith("TcpExt")}


async def burst(session: Any, url: str, count: int) -> dict[str, Any]:
    """COUNT requests at once: their latencies (ms) and the kernel's drops meanwhile."""

    async def one(i: int) -> float:
        started = time.perf_counter()
        body = {"model": "default", "prompt": [5 + i % 100] * 8, "max_tokens": 1, "temperature": 0}
        async with session.post(url, json=body) as reply:
            await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"request {i}: HTTP {reply.status}")
        return time.perf_counter() - started

    before = kernel_counts()
    times = sorted(await asyncio.gather(*(one(i) for i in range(count))))
    after = kernel_counts()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            "max_ms": times[-1] * 1e3, "kernel": {k: after[k] - before.get(k, 0) for k in after}}


async def measure(url: str, count: int) -> dict[str, Any]:
    import aiohttp

    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await burst(session, url, 32)  # the server's first requests
        out["new_connections"] = await burst(session, url, count)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await burst(session, url, count)  # opens COUNT connections, left open
        out["open_connections"] = await burst(session, url, count)
    return out


def main() -> None:
    from bench.server_process import ServerProcess
    from kvtransfer.netaddr import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    port = free_port()
    argv = [sys.executable, "-m", "deploy.cli", "serve", "--colocated", "--decode", "1", "--device", args.device,
            "--num-router-replicas", str(args.replicas), "--max-num-seqs", "256",
            "--max-in-flight", str(4 * args.requests), "--port", str(port), "--grpc-port", str(free_port()),
            "--exit-after", "600"]
    with tempfile.TemporaryDirectory() as scratch:
        server = ServerProcess(argv, dict(os.environ), Path(scratch) / "server.log")
        try:
            server.wait_ready(f"http://127.0.0.1:{port}/v1/models", 240)
            result = asyncio.run(measure(f"http://127.0.0.1:{port}/v1/completions", args.requests))
        finally:
            server.stop(30)
    print(json.dumps({"requests": args.requests, "replicas": args.replicas, "device": args.device, **result}))


if __name__ == "__main__":
    main()
