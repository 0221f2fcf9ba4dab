"""KV transfer between workers of any tensor-parallel layouts: a prefill worker of TP=a pushes to a
decode worker of TP=b, one message per (prefill rank, decode rank) that share KV heads, each
decode rank receiving exactly the heads it owns; nothing is gathered on rank 0.

`RankedKv` is rank 0's view of its worker's KV transfers over all its ranks. Rank 0 moves its own
heads over its own transport (the worker's `transport`, paired under the worker ids); each other
rank k has a transport of its own (peer ids `<worker>#r<k>`), made, paired, and driven by rank
0's RankCalls (engine/parallel/follower.py), which run in order with the steps: a gather there
follows the step that computed the KV, a scatter precedes any step reading it. A rank's side
threads report what finished through its group's store (TPGroup.report); rank 0's handles poll it.

Routes: for each decode rank, the heads it owns, each from the lowest prefill rank holding it
(`routes`); with TP=1 on both sides that is one route of every head, the push as it always was.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.parallel import TPGroup, kv_head_range
from engine.parallel.follower import RankCall
from engine.quant.kv_scales import KvScales, fingerprint
from kvtransfer.layout import KvLayout, gather_blocks, scatter_blocks
from kvtransfer.transport import PairAddress, TransferError, TransferHandle, Transport, create_transport

__all__ = ["RankTable", "RankedKv", "Route", "model_layout", "routes"]


class Route(NamedTuple):
    """Model KV heads [start, stop) go from prefill rank `src` to decode rank `dst`."""

    src: int
    dst: int
    start: int
    stop: int


def routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    out: list[Route] = []
    holders = [kv_head_range(s, src_tp, num_kv_heads) for s in range(src_tp)]
    for dst in range(dst_tp):
        d0, d1 = kv_head_range(dst, dst_tp, num_kv_heads)
        for head in range(d0, d1):
            src = next(s for s, (h0, h1) in enumerate(holders) if h0 <= head < h1)
            if out and out[-1].dst == dst and out[-1].src == src and out[-1].stop == head:
                out[-1] = out[-1]._replace(stop=head + 1)
            else:
                out.append(Route(src, dst, head, head + 1))
    return out


@dataclass(frozen=True)
class RankTable:
    """What a worker tells a peer it pairs with: its ranks and where each one's transport meets."""

    worker_id: str
    addresses: tuple[PairAddress, ...]  # one per rank

    @property
    def tp(self) -> int:
        return len(self.addresses)

    def rank_id(self, rank: int) -> str:
        return self.worker_id if rank == 0 else f"{self.worker_id}#r{rank}"

    def to_wire(self) -> list[Any]:
        return [self.worker_id, [[a.host, a.port] for a in self.addresses]]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> RankTable:
        worker_id, addresses = wire
        return cls(str(worker_id), tuple(PairAddress(str(h), int(p)) for h, p in addresses))


class _RankHandle(TransferHandle):
    """Rank 0's own transfers and what the other ranks report under `keys`."""

    def __init__(self, what: str, own: list[TransferHandle], group: TPGroup | None, keys: list[str]) -> None:
        self._what, self._own, self._group, self._keys = what, own, group, keys
        self._reported: list[str] | None = [] if not keys else None
        self._error: BaseException | None = None

    def _poll(self) -> bool:
        if self._reported is None and self._group is not None:
            self._reported = self._group.reports(self._keys)
        return self._reported is not None and all(h.done() for h in self._own)

    def done(self) -> bool:
        return self._poll()

    def device_seconds(self) -> float | None:
        """Rank 0's own transfers on the device, the longest (the other ranks' pairs run at the same time,
        untimed here); None where rank 0 has no route or its transport does not time them."""
        times = [h.device_seconds() for h in self._own]
        return max(times) if times and None not in times else None  # type: ignore[type-var]

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for handle in self._own:
            if not handle.wait(max(0.0, deadline - time.monotonic())):
                return False
        while not self._poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(2e-4)
        failed = [r for r in self._reported or [] if r != "ok"]
        if failed:
            raise TransferError(f"{self._what} failed on another rank: {failed[0]}")
        return True

    @property
    def error(self) -> BaseException | None:
        if not self._poll():
            return None
        own = next((h.error for h in self._own if h.error is not None), None)
        if own is not None:
            return own
        failed = [r for r in self._reported or [] if r != "ok"]
        return TransferError(f"{self._what} failed on another rank: {failed[0]}") if failed else None


class RankedKv:
    """Rank 0's KV transfers over every rank of its worker (TP=1: its transport alone)."""

    def __init__(self, worker_id: str, transport: Transport, kv: torch.Tensor, num_kv_heads: int,
                 group: TPGroup | None, kind: str, options: dict[str, Any], timeout_s: float) -> None:
        """kv: rank 0's cache; num_kv_heads: the model's; kind/options: how the other ranks build
        their transports (the worker's transport's)."""
        self.worker_id, self.transport, self.kv, self.num_kv_heads = worker_id, transport, kv, num_kv_heads
        self.group = group
        self.tp = group.size if group is not None else 1
        self._tokens = itertools.count()
        self.own_heads = kv_head_range(0, self.tp, num_kv_heads)
        self._peers: dict[str, _Peer] = {}
        self._received: dict[str, list[tuple[int, int, torch.Tensor]]] = {}  # key -> (heads start, stop, buffer)
        addresses = [transport.address()]
        if self.tp > 1:
            assert group is not None
            token = self._token("address")
            self._call(_init_rank, worker_id, transport.layout.to_ints().tolist(), kind, options, token)
            reported = self._await([f"{token}/{k}" for k in range(1, self.tp)], timeout_s, "the ranks' transports")
            addresses += [PairAddress(*_host_port(r)) for r in reported]
        self.table = RankTable(worker_id, tuple(addresses))
        # Pairings block a thread each (up to their timeout, on both sides): threads of their own, never
        # behind the event loop's default pool (grammar compiles) while the peer waits in the rendezvous.
        self._pair_threads = ThreadPoolExecutor(4, thread_name_prefix=f"{worker_id}-pairs")

    # ---- pairing
    async def pair_async(self, peer: RankTable, sends: bool, timeout_s: float) -> None:
        """`pair` on this transport's pairing threads."""
        await asyncio.get_running_loop().run_in_executor(self._pair_threads, self.pair, peer, sends, timeout_s)

    def pair(self, peer: RankTable, sends: bool, timeout_s: float) -> None:
        """Form every rank pair with `peer` (blocking, as Transport.pair). sends: this is the prefill
        side (it joins each pair: rank 1); the decode side hosts them (rank 0) at its own addresses."""
        plan = routes(self.num_kv_heads, self.tp, peer.tp) if sends else routes(self.num_kv_heads, peer.tp, self.tp)
        known = _Peer(peer, _by_rank(plan, sends))
        self._peers[peer.worker_id] = known
        token = self._token("pair")
        pairs = {rank: [(peer.rank_id(p), peer.addresses[p] if sends else self.table.addresses[rank], int(sends))
                        for p in sorted({p for p, _, _ in mine})]
                 for rank, mine in known.routes.items()}
        followers = [k for k in pairs if k > 0]
        for k in followers:
            self._call(_rank_pair, k, pairs[k], timeout_s, token)
        for peer_id, address, side in pairs.get(0, []):
            self.transport.pair(peer_id, address, side, timeout_s)
        answers = self._await([f"{token}/{k}" for k in followers], timeout_s + 1.0, f"pairing with {peer.worker_id}")
        for value in answers:
            if value != "ok":
                raise TransferError(f"pairing a rank of {self.worker_id!r} with {peer.worker_id!r} failed: {value}")

    def is_paired(self, peer_id: str) -> bool:
        return peer_id in self._peers and self.transport.is_paired(peer_id)

    def drop(self, peer_id: str) -> None:
        """Drop every rank pair with `peer_id` (never blocks; unknown peers are ignored)."""
        known = self._peers.pop(peer_id, None)
        self.transport.drop(peer_id)
        if known is None:
            return
        for p, _, _ in known.routes.get(0, []):
            self.transport.drop(known.table.rank_id(p))
        if self.tp > 1:
            self._call(_rank_drop, [known.table.rank_id(k) for k in range(known.table.tp)])

    def _peer(self, peer_id: str) -> _Peer:
        known = self._peers.get(peer_id)
        if known is None:  # NOTE: a ValueError, as a transport's send/recv of an unpaired peer
            raise ValueError(f"{self.worker_id!r} is not paired with {peer_id!r}")
        return known

    def _followers(self, fn: Any, key: str, known: _Peer, what: str, *args: Any) -> list[str]:
        """RankCall `fn` for every other rank with routes to `known`; returns the report keys."""
        token = self._token(what)
        for rank, mine in known.routes.items():
            if rank > 0:
                self._call(fn, key, rank, [(known.table.rank_id(p), lo, hi) for p, lo, hi in mine], *args, token)
        return [f"{token}/{rank}" for rank in known.routes if rank > 0]

    # ---- the prefill side
    def gather_ranks(self, key: str, block_ids: list[int]) -> None:
        """The other ranks gather their heads of `block_ids` (engine thread, right after the step
        that computed them); rank 0 gathers its own (gather_blocks) and passes it to `send`."""
        if self.tp > 1:
            self._call(_rank_gather, key, list(block_ids))

    def send(self, peer_id: str, key: str, own: torch.Tensor) -> TransferHandle:
        """Start every rank's sends of `key` to `peer_id` (own: rank 0's gathered buffer)."""
        known = self._peer(peer_id)
        h0 = self.own_heads[0]
        handles = [self.transport.send(known.table.rank_id(p), _heads(own, lo - h0, hi - h0))
                   for p, lo, hi in known.routes.get(0, [])]
        keys = self._followers(_rank_send, key, known, "send")
        if self.tp > 1:
            self._call(_rank_forget, key)  # NOTE: ranks without a route drop their gathered buffer
        return _RankHandle(f"KV push of {key} to {peer_id!r}", handles, self.group, keys)

    # ---- the decode side
    def recv(self, peer_id: str, key: str, num_blocks: int) -> TransferHandle:
        """Post every rank's receives of `key` from `peer_id` (num_blocks blocks)."""
        known = self._peer(peer_id)
        mine = [(known.table.rank_id(p), lo, hi) for p, lo, hi in known.routes.get(0, [])]
        bufs, handles = _post(self.transport, mine, num_blocks, self.kv.device)
        self._received[key] = bufs
        keys = self._followers(_rank_recv, key, known, "recv", num_blocks)
        return _RankHandle(f"KV receive of {key} from {peer_id!r}", handles, self.group, keys)

    def scatter(self, key: str, block_ids: list[int]) -> None:
        """Engine thread: every rank writes what it received for `key` into `block_ids`."""
        _scatter_all(self.kv, self.own_heads[0], self._received.pop(key, []), block_ids)
        if self.tp > 1:
            self._call(_rank_scatter, key, list(block_ids))

    def forget(self, key: str) -> None:
        """A transfer that will not be scattered (failed, aborted): every rank drops its buffers."""
        self._received.pop(key, None)
        if self.tp > 1:
            self._call(_rank_forget, key)

    def close(self) -> None:
        self._pair_threads.shutdown(wait=False)
        if self.tp > 1:
            self._call(_rank_close)

    # ---- plumbing
    def _token(self, what: str) -> str:
        return f"{self.worker_id}/{what}/{next(self._tokens)}"

    def _call(self, fn: Any, *args: Any) -> None:
        assert self.group is not None
        self.group.broadcast_object(RankCall(fn, args))

    def _await(self, keys: list[str], timeout_s: float, what: str) -> list[str]:
        assert self.group is not None or not keys
        deadline = time.monotonic() + timeout_s
        while keys:
            values = self.group.reports(keys)  # type: ignore[union-attr]
            if values is not None:
                return values
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.worker_id}: {what} did not answer within {timeout_s:.0f} s")
            time.sleep(1e-3)
        return []


class _Peer(NamedTuple):
    """A paired worker: its table, and per rank of this side its routes (peer rank, heads start, stop)."""

    table: RankTable
    routes: dict[int, list[tuple[int, int, int]]]


def _by_rank(plan: list[Route], sends: bool) -> dict[int, list[tuple[int, int, int]]]:
    out: dict[int, list[tuple[int, int, int]]] = {}
    for r in plan:
        mine, theirs = (r.src, r.dst) if sends else (r.dst, r.src)
        out.setdefault(mine, []).append((theirs, r.start, r.stop))
    return out


def _post(transport: Transport, recvs: list[tuple[str, int, int]], num_blocks: int,
          device: torch.device) -> tuple[list[tuple[int, int, torch.Tensor]], list[TransferHandle]]:
    """Post a rank's receives (peer id, heads start, stop): its buffers and handles."""
    layout = transport.layout
    bufs, handles = [], []
    for peer_id, lo, hi in recvs:
        buf = torch.empty(_shape(layout, num_blocks, hi - lo), dtype=layout.torch_dtype, device=device)
        handles.append(transport.recv(peer_id, buf))
        bufs.append((lo, hi, buf))
    return bufs, handles


def _scatter_all(kv: torch.Tensor, first_head: int, received: list[tuple[int, int, torch.Tensor]],
                 block_ids: list[int]) -> None:
    """A rank's received buffers into its cache (its heads start at model head `first_head`)."""
    for lo, hi, buf in received:
        _scatter_heads(kv, lo - first_head, hi - first_head, block_ids, buf)


def model_layout(kv: torch.Tensor, num_kv_heads: int, scales: KvScales | None) -> KvLayout:
    """The layout two workers compare when they pair: the cache's, with the MODEL's KV heads (each
    rank holds some of them; messages carry the heads of their route) and its KV scales (EngineCore.kv_scales)."""
    return dataclasses.replace(KvLayout.from_kv(kv, fingerprint(scales)), num_kv_heads=num_kv_heads)


def _shape(layout: KvLayout, num_blocks: int, heads: int) -> tuple[int, ...]:
    shape = list(layout.buffer_shape(num_blocks))
    shape[4] = heads
    return tuple(shape)


def _scatter_heads(kv: torch.Tensor, lo: int, hi: int, block_ids: list[int], buf: torch.Tensor) -> None:
    """scatter_blocks into heads [lo, hi) of kv [layers, 2, blocks, block_size, heads, head_dim]."""
    if lo == 0 and hi == kv.shape[4]:
        scatter_blocks(kv, block_ids, buf)
        return
    index = torch.tensor(block_ids, dtype=torch.long).to(kv.device, non_blocking=True)
    kv[:, :, :, :, lo:hi].index_copy_(2, index, buf)  # NOTE: a strided view: written in place


def _heads(buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A contiguous buffer of heads [lo, hi) of a gathered buffer (itself when that is all of them)."""
    return buf if lo == 0 and hi == buf.shape[4] else buf[:, :, :, :, lo:hi].contiguous()


def _host_port(value: str) -> tuple[str, int]:
    host, port = value.rsplit(":", 1)
    return host, int(port)


# ---- what the other ranks run (RankCalls: fn(follower, *args), on the follower's loop thread)
def _state(f: Any) -> dict[str, Any]:
    return f.__dict__.setdefault("kv_transfer", {"gathered": {}, "received": {}})


def _own_heads(f: Any) -> tuple[int, int]:
    return kv_head_range(f.group.rank, f.group.size, f.parts.arch.num_kv_heads)


def _report_when_done(f: Any, handles: list[TransferHandle], key: str, timeout_s: float = 600.0) -> None:
    def wait() -> None:
        value = "ok"
        for handle in handles:
            try:
                if not handle.wait(timeout_s):
                    value = "timed out"
            except Exception as err:  # noqa: BLE001 - reported to rank 0
                value = str(err)
        f.group.report(key, value)

    threading.Thread(target=wait, name=f"kv-report-{f.group.rank}", daemon=True).start()


def _init_rank(f: Any, worker_id: str, layout_ints: list[int], kind: str, options: dict[str, Any], token: str) -> None:
    rank = f.group.rank
    transport = create_transport(kind, f"{worker_id}#r{rank}", KvLayout.from_ints(layout_ints), f.device, **options)
    _state(f)["transport"] = transport
    address = transport.address()
    f.group.report(f"{token}/{rank}", f"{address.host}:{address.port}")


def _rank_pair(f: Any, rank: int, pairs: list[tuple[str, PairAddress, int]], timeout_s: float, token: str) -> None:
    if f.group.rank != rank:
        return

    def pair() -> None:
        value = "ok"
        try:
            for peer_id, address, side in pairs:
                _state(f)["transport"].pair(peer_id, address, side, timeout_s)
        except Exception as err:  # noqa: BLE001 - reported to rank 0
            value = f"{type(err).__name__}: {err}"
        f.group.report(f"{token}/{rank}", value)

    threading.Thread(target=pair, name=f"kv-pair-{rank}", daemon=True).start()  # NOTE: pair() blocks


def _rank_drop(f: Any, peer_ids: list[str]) -> None:
    for peer_id in peer_ids:
        _state(f)["transport"].drop(peer_id)


def _rank_gather(f: Any, key: str, block_ids: list[int]) -> None:
    _state(f)["gathered"][key] = gather_blocks(f.kv, block_ids)


def _rank_send(f: Any, key: str, rank: int, sends: list[tuple[str, int, int]], token: str) -> None:
    if f.group.rank != rank:
        return
    state = _state(f)
    buf = state["gathered"].pop(key)
    h0, _ = _own_heads(f)
    handles = [state["transport"].send(peer_id, _heads(buf, lo - h0, hi - h0)) for peer_id, lo, hi in sends]
    _report_when_done(f, handles, f"{token}/{rank}")


def _rank_recv(f: Any, key: str, rank: int, recvs: list[tuple[str, int, int]], num_blocks: int, token: str) -> None:
    if f.group.rank != rank:
        return
    state = _state(f)
    bufs, handles = _post(state["transport"], recvs, num_blocks, f.device)
    state["received"][key] = bufs
    _report_when_done(f, handles, f"{token}/{rank}")


def _rank_scatter(f: Any, key: str, block_ids: list[int]) -> None:
    _scatter_all(f.kv, _own_heads(f)[0], _state(f)["received"].pop(key, []), block_ids)


def _rank_forget(f: Any, key: str) -> None:
    state = _state(f)
    state["gathered"].pop(key, None)
    state["received"].pop(key, None)


def _rank_close(f: Any) -> None:
    transport = _state(f).pop("transport", None)
    if transport is not None:
        transport.close()
