"""The fault-injecting transport over local and gloo: with no rule it moves bytes like its inner
transport; drop stalls a direction until the pair is dropped, delay holds a transfer (and those
behind it) back without reordering, fail and kill break the pair on both sides, kill makes the peer
unreachable for a while; rules fire by count, by probability and at most max_fires times; a
re-formed pair moves data again. Each test ends with the transports closed and no thread left."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import LocalHub, TransferError, Transport, create_transport, gather_blocks
from kvtransfer.fault import FaultRule, FaultTransport
from tests.unit.kvtransfer.conftest import LAYOUT, NUM_BLOCKS, pair_both

WAIT_S = 5.0


class Faulty:
    """Builds a fault-wrapped prefill side and a plain decode side over one inner kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.hub = LocalHub()
        self.built: list[Transport] = []

    def options(self) -> dict[str, object]:
        return {"hub": self.hub} if self.kind == "local" else {"max_transfer_s": 30.0}

    def pair(self, rules: list[FaultRule] | None = None) -> tuple[FaultTransport, Transport]:
        a = create_transport("fault", "prefill-0", LAYOUT, "cpu", inner=self.kind, inner_options=self.options(),
                             rules=rules, seed=0)
        b = create_transport(self.kind, "decode-0", LAYOUT, "cpu", **self.options())
        self.built += [a, b]
        assert pair_both(b, a) == [None, None]  # the decode side hosts, as the workers do
        assert isinstance(a, FaultTransport)
        return a, b


def _kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtransfer-")]


@pytest.fixture(params=["local", "gloo"])
def faulty(request: pytest.FixtureRequest) -> Iterator[Faulty]:
    built = Faulty(request.param)
    yield built
    for transport in built.built:
        transport.close()
    deadline = time.monotonic() + 3.0
    while _kv_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _kv_threads(), f"transport threads still running after close: {_kv_threads()}"


def _bufs(count: int) -> list[torch.Tensor]:
    shape = (LAYOUT.num_layers, 2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    kv = torch.rand(shape)
    return [gather_blocks(kv, [i, i + 1]) for i in range(count)]


def _move_ok(a: Transport, b: Transport) -> None:
    (buf,) = _bufs(1)
    landing = torch.empty_like(buf)
    recv = b.recv(a.self_id, landing)
    assert a.send(b.self_id, buf).wait(WAIT_S) and recv.wait(WAIT_S)
    assert torch.equal(landing, buf)


def test_without_rules_it_moves_bytes_like_its_inner_transport(faulty: Faulty) -> None:
    a, b = faulty.pair()
    assert a.inner.name == faulty.kind and a.is_paired("decode-0")
    _move_ok(a, b)
    assert a.stats().num_transfers == 1 and a.stats().num_fired == {}


def test_drop_stalls_the_direction_until_the_pair_is_dropped_then_it_pairs_again(faulty: Faulty) -> None:
    a, b = faulty.pair([FaultRule(action="drop", op="send")])
    first, second = _bufs(2)
    landings = [torch.empty_like(first), torch.empty_like(second)]
    recvs = [b.recv(a.self_id, landing) for landing in landings]
    sends = [a.send(b.self_id, first), a.send(b.self_id, second)]  # the second queues behind the dropped one
    assert sends[0].wait(0.3) is False and sends[1].wait(0.05) is False
    assert not recvs[0].done() and not recvs[1].done()
    start = time.monotonic()
    a.drop(b.self_id)  # what a worker does once the deadline has passed
    assert time.monotonic() - start < 0.05, "drop() must not block"
    for handle in sends + recvs:
        with pytest.raises(TransferError):
            handle.wait(2.0)  # the peer's recvs fail too: the pair is gone on both sides
    b.drop(a.self_id)
    assert pair_both(b, a) == [None, None]
    _move_ok(a, b)  # max_fires=1: the rule is spent


def test_delay_holds_a_transfer_back_without_reordering_the_direction(faulty: Faulty) -> None:
    a, b = faulty.pair([FaultRule(action="delay", op="send", delay_s=0.4)])
    bufs = _bufs(3)
    landings = [torch.empty_like(buf) for buf in bufs]
    recvs = [b.recv(a.self_id, landing) for landing in landings]
    start = time.monotonic()
    sends = [a.send(b.self_id, buf) for buf in bufs]  # only the first is faulted; the others wait behind it
    assert sends[2].wait(0.2) is False
    assert all(h.wait(WAIT_S) for h in sends + recvs)
    assert time.monotonic() - start >= 0.4
    for buf, landing in zip(bufs, landings):
        assert torch.equal(landing, buf)
    assert a.stats().num_fired == {"delay": 1}


@pytest.mark.parametrize("action", ["fail", "kill"])
def test_fail_and_kill_break_the_pair_on_both_sides(faulty: Faulty, action: str) -> None:
    a, b = faulty.pair([FaultRule(action=action, op="send")])
    (buf,) = _bufs(1)
    recv = b.recv(a.self_id, torch.empty_like(buf))
    send = a.send(b.self_id, buf)
    with pytest.raises(TransferError, match=f"fault injected: {action}"):
        send.wait(0.0)
    assert not a.is_paired(b.self_id)
    with pytest.raises(TransferError):
        recv.wait(2.0)
    b.drop(a.self_id)
    assert pair_both(b, a) == [None, None]
    _move_ok(a, b)


def test_kill_makes_the_peer_unreachable_for_a_while(faulty: Faulty) -> None:
    a, b = faulty.pair([FaultRule(action="kill", op="recv", unreachable_s=0.6)])
    with pytest.raises(TransferError):
        a.recv(b.self_id, torch.empty(LAYOUT.buffer_shape(1))).wait(0.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="unreachable"):
        a.pair(b.self_id, b.address(), 1, 0.2)  # like a dead peer: nobody comes until the timeout
    assert 0.15 < time.monotonic() - start < 1.0
    b.drop(a.self_id)
    time.sleep(0.5)
    assert pair_both(b, a) == [None, None]
    _move_ok(a, b)


@pytest.mark.parametrize("faulty", ["local"], indirect=True)
def test_rules_fire_by_count_by_probability_and_at_most_max_fires(faulty: Faulty) -> None:
    a, b = faulty.pair()
    a.arm(FaultRule(action="delay", op="send", nth=3, delay_s=0.01))
    a.arm(FaultRule(action="delay", op="recv", probability=0.5, max_fires=None, delay_s=0.001))
    a.arm(FaultRule(action="delay", op="any", peer_id="someone-else", delay_s=0.01))  # never matches
    (buf,) = _bufs(1)
    for _ in range(40):
        recv = b.recv(a.self_id, torch.empty_like(buf))
        assert a.send(b.self_id, buf).wait(WAIT_S) and recv.wait(WAIT_S)
        send = b.send(a.self_id, buf)
        assert a.recv(b.self_id, torch.empty_like(buf)).wait(WAIT_S) and send.wait(WAIT_S)
    stats = a.stats()
    assert stats.num_transfers == 80
    sends_fired = [f for f in stats.fired_at if f[1] == "send"]
    recvs_fired = [f for f in stats.fired_at if f[1] == "recv"]
    assert len(sends_fired) == 1  # the 3rd send only
    assert 10 <= len(recvs_fired) <= 30  # about half of 40, seeded
    a.disarm()
    recv = b.recv(a.self_id, torch.empty_like(buf))
    assert a.send(b.self_id, buf).wait(WAIT_S) and recv.wait(WAIT_S)
    assert len(a.stats().fired_at) == len(stats.fired_at)


def test_rules_are_validated_and_travel_as_msgpack() -> None:
    rule = FaultRule(action="delay", op="send", delay_s=2.5, nth=4, peer_id="decode-1")
    assert FaultRule.decode(rule.encode()) == rule
    with pytest.raises(ValueError, match="delay_s must be > 0"):
        FaultRule(action="delay")
    with pytest.raises(ValueError):
        FaultRule(action="drop", nth=0)
    with pytest.raises(ValueError):
        FaultRule(action="explode")  # type: ignore[arg-type]


def test_the_registry_builds_it_around_a_transport_that_runs_on_the_device() -> None:
    built = create_transport("fault", "w", LAYOUT, "cpu")
    try:
        assert isinstance(built, FaultTransport) and built.inner.name == "gloo"  # nccl cannot run on the CPU
    finally:
        built.close()
    with pytest.raises(ValueError, match="cannot wrap another fault transport"):
        create_transport("fault", "w", LAYOUT, "cpu", inner="fault")
    with pytest.raises(ValueError, match="'nccl' cannot run on cpu"):
        create_transport("fault", "w", LAYOUT, "cpu", inner="nccl")
