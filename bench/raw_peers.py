"""Our KV transport between Ray actors with nothing on top (no engine, no gather, no handshake): the
raw baseline the KV-transfer benchmarks compare against.

  RawPeer          one actor, one transport; pairs with any number of peers, moves random bf16
                   buffers to and from them, one at a time (`move`) or all at once in a timed loop (`run`)
  form_pair        pairs two RawPeers (the first one hosts the rendezvous)
  pair_bandwidth   send->recv bandwidth of one formed pair, timed on the sender (bench.disagg's method)
  raw_bandwidth    the same on two fresh actors, one per GPU

Knows nothing of topologies, of what a benchmark reports, or of KV blocks. Every wait has a timeout.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import ray
import torch

from kvtransfer import KvLayout, PairAddress, create_transport

__all__ = ["RawPeer", "form_pair", "pair_bandwidth", "pair_bandwidths", "raw_bandwidth", "raw_bandwidths"]

_START_TIMEOUT_S = 180.0  # an actor's start: Ray worker, torch import, CUDA context
_SPIN_S = 0.002  # sleep until this close to an agreed start instant, then spin: sleep() overshoots ~0.1 ms


@ray.remote(num_cpus=0)
class RawPeer:
    """One side of raw transfers: our transport and one buffer per peer, nothing else."""

    def __init__(self, peer_id: str, transport: str, device: str) -> None:
        layout = KvLayout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1, dtype="bfloat16")
        self.peer_id = peer_id
        self.device = device
        self.transport = create_transport(transport, peer_id, layout, device)
        self.bufs: dict[str, torch.Tensor] = {}  # peer id -> the buffer sent to / received from it

    def address(self) -> tuple[str, int]:
        a = self.transport.address()
        return a.host, a.port

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (physical ids), empty on the CPU."""
        return [str(g) for g in ray.get_gpu_ids()]

    def pair(self, peer_id: str, host: str, port: int, rank: int, timeout_s: float = 60.0) -> None:
        self.transport.pair(peer_id, PairAddress(host, port), rank, timeout_s)

    def alloc(self, num_bytes: int, peer_ids: list[str]) -> None:
        """One buffer of `num_bytes` (random bf16) per peer, replacing all earlier buffers."""
        self.bufs = {}  # NOTE: freed before the new ones are made, so peak memory is one set
        for peer_id in peer_ids:
            self.bufs[peer_id] = torch.randn(num_bytes // 2, device=self.device).to(torch.bfloat16)
        if self.device != "cpu":
            torch.cuda.synchronize()

    def move(self, peer_id: str, op: str, timeout_s: float = 60.0) -> float:
        """Seconds one send ("send") or recv ("recv") of the peer's buffer takes, from its start."""
        return self.move_timed(peer_id, op, timeout_s)[0]

    def move_timed(self, peer_id: str, op: str, timeout_s: float = 60.0) -> tuple[float, float | None]:
        """`move`'s seconds, and the transfer's own time on the device (None where not timed)."""
        start = time.perf_counter()
        handle = self._start(peer_id, op)
        if not handle.wait(timeout_s):
            raise TimeoutError(f"{self.peer_id}: {op} with {peer_id!r} not done within {timeout_s} s")
        return time.perf_counter() - start, handle.device_seconds()

    def run(self, ops: list[tuple[str, str]], num_iters: int, start_at: float, timeout_s: float,
            poll_s: float) -> list[list[float]]:
        """From `start_at` (time.monotonic()), `num_iters` times: start every (peer id, "send"|"recv")
        in `ops` at once, then poll until all have finished (sleeping `poll_s` between polls; 0 spins).

        Returns one row per iteration: [start, end of ops[0], end of ops[1], ...], time.monotonic()
        seconds (NOTE: on Linux one clock for every process of the host, so rows of different actors
        compare). Raises TimeoutError if the loop is not done `timeout_s` after `start_at`, after
        dropping the pairs still busy (so their GPU work is released), and TransferError if an op failed.
        """
        deadline = start_at + timeout_s
        _sleep_until(start_at)
        rows = []
        for _ in range(num_iters):
            start = time.monotonic()
            handles = [self._start(peer_id, op) for peer_id, op in ops]
            ends = [0.0] * len(ops)
            pending = list(range(len(ops)))
            while pending:
                for i in list(pending):
                    if handles[i].done():
                        ends[i] = time.monotonic()
                        pending.remove(i)
                        handles[i].wait(0.0)  # raises the transfer's error, if it failed
                if not pending:
                    break
                if time.monotonic() > deadline:
                    for i in pending:
                        self.transport.drop(ops[i][0])
                    busy = ", ".join(f"{ops[i][1]} with {ops[i][0]}" for i in pending)
                    raise TimeoutError(f"{self.peer_id}: {busy} not done {timeout_s} s after the start "
                                       f"(its pair dropped); raise timeout_s if the transfers are just slow")
                if poll_s:
                    time.sleep(poll_s)
            rows.append([start, *ends])
        return rows

    def close(self) -> None:
        self.transport.close()

    def _start(self, peer_id: str, op: str) -> Any:
        if op not in ("send", "recv"):
            raise ValueError(f"op must be 'send' or 'recv', got {op!r}")
        buf = self.bufs.get(peer_id)
        if buf is None:
            raise ValueError(f"{self.peer_id} has no buffer for {peer_id!r}; "
                             f"call alloc(num_bytes, [{peer_id!r}]) first")
        return (self.transport.send if op == "send" else self.transport.recv)(peer_id, buf)


def _sleep_until(instant: float) -> None:
    """Until time.monotonic() reaches `instant`: sleep most of the way, spin the rest."""
    while (left := instant - time.monotonic()) > 0:
        if left > _SPIN_S:
            time.sleep(left - _SPIN_S)


def form_pair(host: Any, host_id: str, joiner: Any, joiner_id: str, timeout_s: float = 60.0) -> None:
    """Pair two RawPeers; `host` (rank 0) hosts the rendezvous. Raises if not paired within about `timeout_s`."""
    address = ray.get(host.address.remote(), timeout=timeout_s)
    ray.get([host.pair.remote(joiner_id, *address, 0, timeout_s), joiner.pair.remote(host_id, *address, 1, timeout_s)],
            timeout=timeout_s + 10)


def pair_bandwidth(sender: Any, sender_id: str, receiver: Any, receiver_id: str, sizes: list[int], iters: int,
                   timeout_s: float = 60.0) -> dict[int, float]:
    """Median GB/s of send->recv on a formed pair for each message size (bytes), timed on the sender
    (its time includes any wait for the receiver to post its recv), after 3 warm-up transfers."""
    return {size: host for size, (host, _) in pair_bandwidths(sender, sender_id, receiver, receiver_id, sizes, iters,
                                                             timeout_s).items()}


def pair_bandwidths(sender: Any, sender_id: str, receiver: Any, receiver_id: str, sizes: list[int], iters: int,
                    timeout_s: float = 60.0) -> dict[int, tuple[float, float | None]]:
    """`pair_bandwidth`, and beside it the median GB/s by the send's own time on the device (CUDA
    events on the pair's stream; None where the transport does not time it)."""
    out = {}
    for size in sizes:
        ray.get([sender.alloc.remote(size, [receiver_id]), receiver.alloc.remote(size, [sender_id])], timeout=timeout_s)
        times, device_times = [], []
        for i in range(iters + 3):
            recv = receiver.move.remote(sender_id, "recv", timeout_s)
            sent, on_device = ray.get(sender.move_timed.remote(receiver_id, "send", timeout_s), timeout=timeout_s + 10)
            ray.get(recv, timeout=timeout_s + 10)
            if i >= 3:
                times.append(sent)
                if on_device is not None:
                    device_times.append(on_device)
        device_gbps = size / statistics.median(device_times) / 1e9 if device_times else None
        out[size] = (size / statistics.median(times) / 1e9, device_gbps)
    return out


def raw_bandwidth(sizes: list[int], iters: int, transport: str, device: str) -> dict[int, float]:
    """Median GB/s of send->recv between two fresh workers (one GPU each) for each message size (bytes)."""
    return {size: host for size, (host, _) in raw_bandwidths(sizes, iters, transport, device).items()}


def raw_bandwidths(sizes: list[int], iters: int, transport: str, device: str) -> dict[int, tuple[float, float | None]]:
    """`raw_bandwidth`, and the same by the send's time on the device (`pair_bandwidths`)."""
    gpus = 1 if device != "cpu" else 0
    a, b = (RawPeer.options(num_gpus=gpus).remote(f"peer-{x}", transport, device) for x in "ab")
    try:
        ray.get([a.gpu_ids.remote(), b.gpu_ids.remote()], timeout=_START_TIMEOUT_S)  # both started
        form_pair(a, "peer-a", b, "peer-b")
        return pair_bandwidths(a, "peer-a", b, "peer-b", sizes, iters)
    finally:
        for actor in (a, b):
            ray.kill(actor)
