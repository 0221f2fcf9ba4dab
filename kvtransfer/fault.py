"""FaultTransport: a Transport that wraps a real one (built by name) and injects faults into its
transfers, for the chaos tests. Registered as "fault"; `create_transport("fault", ..., inner="gloo",
rules=[...])`, or armed while serving with `arm(FaultRule(...))` (the workers' `arm_fault`).

A rule is checked on each data transfer (send or recv; the pairing handshake is never faulted) and,
when it fires, does one of:

| action | what the transfer's handle sees                 | what happens to the pair                      |
|--------|-------------------------------------------------|-----------------------------------------------|
| drop   | never finishes: wait() times out                | this and later transfers in the same direction |
|        | (fails once the pair is dropped)                | stall until the pair is dropped or re-formed   |
| delay  | finishes `delay_s` later than it would have     | later transfers in that direction queue behind |
| fail   | fails at once (TransferError)                   | broken: dropped here, so the peer's side fails |
| kill   | fails at once (TransferError)                   | dropped, and the peer is unreachable (pairing  |
|        |                                                 | with it fails) for `unreachable_s` seconds     |

NOTE: why drop stalls, and fail breaks, the whole direction: a pair's transfers are matched by
order (the n-th send fills the n-th posted recv). Skipping one transfer and letting the next through
would land one request's KV in another's blocks; a real link either delivers in order, stalls, or
breaks, and so does this one.

A rule fires by probability (each matching transfer), by count (`nth`: the n-th matching transfer
after arming), or both, at most `max_fires` times. This module knows nothing of leases or Ray.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtransfer.layout import KvLayout
from kvtransfer.transport import (
    EventHandle,
    PairAddress,
    TransferError,
    TransferHandle,
    Transport,
    available_transports,
    create_transport,
    register_transport,
)

__all__ = ["FaultRule", "FaultTransport", "FaultStats"]

Op = Literal["send", "recv"]


class FaultRule(BaseModel):
    """One fault to inject; sent to workers msgpack-encoded (`encode`/`decode`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: Literal["drop", "delay", "fail", "kill"] = Field(description="What the fault does (module docstring).")
    op: Literal["send", "recv", "any"] = Field("any", description="Which transfers the rule looks at.")
    peer_id: str | None = Field(None, description="Only transfers with this peer; None: any peer.")
    probability: float = Field(1.0, ge=0.0, le=1.0, description="Chance that a matching transfer is faulted.")
    nth: int | None = Field(None, ge=1, description="Only the n-th matching transfer after arming (1: the next).")
    max_fires: int | None = Field(1, ge=1, description="Fires at most this often; None: no limit.")
    delay_s: float = Field(0.0, ge=0.0, description="delay: how much later the transfer (and those behind it) ends.")
    unreachable_s: float = Field(0.0, ge=0.0, description="kill: how long pairing with the peer fails afterwards.")

    @model_validator(mode="after")
    def _check(self) -> FaultRule:
        if self.action == "delay" and self.delay_s <= 0:
            raise ValueError("delay_s must be > 0 for a delay rule")
        return self

    def encode(self) -> bytes:
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> FaultRule:
        return cls.model_validate(msgpack.unpackb(data, raw=False))


@dataclass
class FaultStats:
    num_transfers: int = 0  # data transfers seen (send + recv)
    num_fired: dict[str, int] = field(default_factory=dict)  # action -> times fired
    fired_at: list[tuple[str, str, str, float]] = field(default_factory=list)  # (action, op, peer, time.time())


@dataclass
class _Armed:
    rule: FaultRule
    num_seen: int = 0
    num_fired: int = 0

    def fires(self, op: Op, peer_id: str, rng: random.Random) -> bool:
        rule = self.rule
        if rule.op not in ("any", op) or (rule.peer_id is not None and rule.peer_id != peer_id):
            return False
        if rule.max_fires is not None and self.num_fired >= rule.max_fires:
            return False
        self.num_seen += 1
        if rule.nth is not None and self.num_seen != rule.nth:
            return False
        if rng.random() >= rule.probability:
            return False
        self.num_fired += 1
        return True


class _GatedHandle(TransferHandle):
    """A transfer held back in its direction's queue; once issued it follows the inner handle."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._issued = threading.Event()
        self._inner: TransferHandle | None = None
        self._error: BaseException | None = None

    def issue(self, inner: TransferHandle) -> None:
        self._inner = inner
        self._issued.set()  # NOTE: after _inner is written, so a reader that sees the event sees it

    def fail(self, error: BaseException) -> None:
        if not self._issued.is_set():
            self._error = error
            self._issued.set()

    def done(self) -> bool:
        return self._issued.is_set() and (self._inner is None or self._inner.done())

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._issued.wait(max(0.0, timeout_s)):
            return False
        if self._inner is None:
            raise TransferError(f"{self._what} failed: {self._error}") from self._error
        return self._inner.wait(max(0.0, deadline - time.monotonic()))

    @property
    def error(self) -> BaseException | None:
        if not self._issued.is_set():
            return None
        if self._inner is None:
            return TransferError(f"{self._what} failed: {self._error}")
        return self._inner.error


@dataclass
class _Queued:
    tensor: torch.Tensor
    handle: _GatedHandle
    not_before: float  # time.monotonic(); math.inf: dropped (never issued)


@dataclass
class _Direction:
    """One direction (op) with one peer: transfers held back, in issue order."""

    queue: deque[_Queued] = field(default_factory=deque)


@register_transport
class FaultTransport(Transport):
    """Wraps the transport registered as `inner` and faults its transfers by rule (module docstring).

    Threads: one daemon thread ("kvtransfer-fault-<self_id>") issues held-back transfers when their
    time comes; send/recv/drop never block, as the Transport contract asks.
    """

    name = "fault"
    supports_cpu = True  # NOTE: as capable as its inner transport, which create_transport checks
    supports_cuda = True

    def __init__(
        self,
        self_id: str,
        layout: KvLayout,
        device: torch.device | str,
        inner: str | None = None,
        inner_options: dict[str, Any] | None = None,
        rules: list[FaultRule | dict[str, Any]] | None = None,
        seed: int = 0,
    ) -> None:
        """inner: the transport that moves the bytes; None picks the first of nccl, gloo that can
        run on `device`. inner_options go to its constructor. rules are armed at once."""
        super().__init__(self_id, layout, device)
        self.inner = _create_inner(inner, self_id, layout, self.device, inner_options or {})
        self._rng = random.Random(seed)
        self._lock = threading.Condition()  # guards rules, directions, unreachable, stats
        self._armed: list[_Armed] = [_Armed(_as_rule(r)) for r in rules or []]
        self._directions: dict[tuple[str, Op], _Direction] = {}
        self._unreachable_until: dict[str, float] = {}  # peer -> time.monotonic()
        self._stats = FaultStats()
        self._closed = False
        self._issuer: threading.Thread | None = None

    # ---- arming
    def arm(self, rule: FaultRule | dict[str, Any]) -> None:
        """Adds a rule; rules are checked in the order armed, and the first that fires applies."""
        with self._lock:
            self._armed.append(_Armed(_as_rule(rule)))

    def disarm(self) -> None:
        """Removes every rule (transfers already held back stay held)."""
        with self._lock:
            self._armed.clear()

    def stats(self) -> FaultStats:
        with self._lock:
            s = self._stats
            return FaultStats(s.num_transfers, dict(s.num_fired), list(s.fired_at))

    # ---- the Transport interface
    def address(self) -> PairAddress:
        return self.inner.address()

    def pair(self, peer_id: str, address: PairAddress, rank: int, timeout_s: float) -> None:
        with self._lock:
            until = self._unreachable_until.get(peer_id, 0.0)
        remaining = until - time.monotonic()
        if remaining > 0:
            # What pairing with a dead peer looks like: nobody comes until the timeout.
            time.sleep(min(remaining, timeout_s))
            if remaining >= timeout_s:
                raise TimeoutError(f"{peer_id!r} did not pair within {timeout_s} s (unreachable: fault injected)")
        self._fail_held(peer_id, "the pair was re-formed")
        self.inner.pair(peer_id, address, rank, timeout_s)

    def send(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        return self._transfer("send", peer_id, tensor)

    def recv(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        return self._transfer("recv", peer_id, tensor)

    def drop(self, peer_id: str) -> None:
        self._fail_held(peer_id, f"{self.self_id!r} dropped its pair with {peer_id!r}")
        self.inner.drop(peer_id)

    def is_paired(self, peer_id: str) -> bool:
        return self.inner.is_paired(peer_id)

    def close(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            self._closed = True
            peers = {peer for peer, _ in self._directions}
            self._lock.notify_all()
        for peer_id in peers:
            self._fail_held(peer_id, f"{self.self_id!r} closed its transport")
        if self._issuer is not None:
            self._issuer.join(timeout_s)
        self.inner.close(timeout_s)

    # ---- faults
    def _transfer(self, op: Op, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        what = f"{op} {'to' if op == 'send' else 'from'} {peer_id!r}"
        with self._lock:
            self._stats.num_transfers += 1
            rule = next((a.rule for a in self._armed if a.fires(op, peer_id, self._rng)), None)
            if rule is not None:
                self._stats.num_fired[rule.action] = self._stats.num_fired.get(rule.action, 0) + 1
                self._stats.fired_at.append((rule.action, op, peer_id, time.time()))
                if rule.action == "kill" and rule.unreachable_s > 0:
                    self._unreachable_until[peer_id] = time.monotonic() + rule.unreachable_s
            if rule is None or rule.action in ("drop", "delay"):
                direction = self._directions.setdefault((peer_id, op), _Direction())
                if rule is not None or direction.queue:
                    behind = direction.queue[-1].not_before if direction.queue else 0.0
                    if rule is None:
                        not_before = behind  # NOTE: never overtakes a transfer held before it
                    elif rule.action == "drop":
                        not_before = math.inf
                    else:
                        not_before = max(time.monotonic() + rule.delay_s, behind)
                    handle = _GatedHandle(what)
                    direction.queue.append(_Queued(tensor, handle, not_before))
                    self._ensure_issuer()
                    self._lock.notify_all()
                    return handle
        if rule is not None:  # fail or kill: the pair breaks, so no later transfer takes this one's place
            self.drop(peer_id)
            failed = EventHandle(what)
            failed.finish(TransferError(f"fault injected: {rule.action} ({self.self_id!r} dropped the pair)"))
            return failed
        return self._start(op, peer_id, tensor)

    def _start(self, op: Op, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        return self.inner.send(peer_id, tensor) if op == "send" else self.inner.recv(peer_id, tensor)

    def _fail_held(self, peer_id: str, reason: str) -> None:
        with self._lock:
            held: list[_Queued] = []
            for op in ("send", "recv"):
                direction = self._directions.pop((peer_id, op), None)
                if direction is not None:
                    held += direction.queue
        for item in held:
            item.handle.fail(TransferError(reason))

    def _ensure_issuer(self) -> None:  # under self._lock
        if self._issuer is None or not self._issuer.is_alive():
            self._issuer = threading.Thread(target=self._issue_loop, name=f"kvtransfer-fault-{self.self_id}",
                                            daemon=True)
            self._issuer.start()

    def _issue_loop(self) -> None:
        """Issues held-back transfers whose time has come, in order per direction; exits when none
        are held (a later hold starts it again) or the transport closes.

        NOTE: issues under the lock (send/recv never block), so a transfer is never issued after a
        drop or a re-pairing has failed it, nor onto a pair formed after it was held."""
        with self._lock:
            while True:
                next_at = math.inf
                for (peer_id, op), direction in self._directions.items():
                    while direction.queue and direction.queue[0].not_before <= time.monotonic():
                        item = direction.queue.popleft()
                        try:
                            item.handle.issue(self._start(op, peer_id, item.tensor))
                        except Exception as err:  # noqa: BLE001 - e.g. not paired any more
                            item.handle.fail(err)
                    if direction.queue:
                        next_at = min(next_at, direction.queue[0].not_before)
                if self._closed or not any(d.queue for d in self._directions.values()):
                    self._issuer = None
                    return
                self._lock.wait(None if next_at == math.inf else max(0.0, next_at - time.monotonic()))


def _as_rule(rule: FaultRule | dict[str, Any]) -> FaultRule:
    return rule if isinstance(rule, FaultRule) else FaultRule.model_validate(rule)


def _create_inner(name: str | None, self_id: str, layout: KvLayout, device: torch.device,
                  options: dict[str, Any]) -> Transport:
    """The named transport, or (None) the first of nccl, gloo that can run on `device`."""
    if name == FaultTransport.name:
        raise ValueError("a fault transport cannot wrap another fault transport")
    if name is not None:
        return create_transport(name, self_id, layout, device, **options)
    for candidate in ("nccl", "gloo"):
        try:
            return create_transport(candidate, self_id, layout, device, **options)
        except ValueError:
            continue
    raise ValueError(f"no transport to wrap runs on {device.type}; known: {', '.join(available_transports())}")
