"""Unit tests of the transports, each run against local, gloo (two threads of this process, rank 0
hosting the store) and nccl (two GPUs, marked gpu): moving a gathered KV buffer into other block
ids, the layout check at pairing, recv timeouts, drop and re-pair, ordering; plus the registry."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from kvtransfer import (
    KvLayout, LayoutMismatchError, TransferError, Transport, available_transports, create_transport,
    gather_blocks, scatter_blocks,
)
from kvtransfer.rendezvous import handshake
from tests.unit.kvtransfer.conftest import _NEEDS_TWO_GPUS, LAYOUT, Builder, pair_both

WAIT_S = 5.0  # generous bound for transfers that should finish in milliseconds


def _paired(builder: Builder) -> tuple[Transport, Transport]:
    a, b = builder.make("prefill-0", index=0), builder.make("decode-0", index=1)
    assert pair_both(a, b) == [None, None]
    assert a.is_paired("decode-0") and b.is_paired("prefill-0")
    return a, b


def _move(builder: Builder, a: Transport, b: Transport, src_ids: list[int], dst_ids: list[int]) -> None:
    """Gather src_ids of a fresh cache on a, move it, scatter into dst_ids on b; check the bytes."""
    kv_a, kv_b = builder.kv(0), builder.kv(1, fill="zeros")
    buf = gather_blocks(kv_a, src_ids)  # [layers, 2, n, block_size, kv_heads, head_dim]
    landing = torch.empty_like(buf, device=builder.device(1))
    recv = b.recv(a.self_id, landing)  # posted first: the common case (decode waits for its lease)
    send = a.send(b.self_id, buf)
    assert send.wait(WAIT_S) and recv.wait(WAIT_S) and recv.done() and recv.error is None
    scatter_blocks(kv_b, dst_ids, landing)
    assert torch.equal(kv_b[:, :, dst_ids].cpu(), kv_a[:, :, src_ids].cpu())
    others = sorted(set(range(kv_b.shape[2])) - set(dst_ids))
    assert not kv_b[:, :, others].any()


def test_moves_gathered_blocks_into_other_block_ids(builder: Builder) -> None:
    a, b = _paired(builder)
    _move(builder, a, b, src_ids=[5, 1, 9, 30, 2], dst_ids=[2, 17, 3, 11, 31])


def test_send_before_recv_also_arrives(builder: Builder) -> None:
    a, b = _paired(builder)
    buf = gather_blocks(builder.kv(0), [3, 4])
    send = a.send(b.self_id, buf)
    landing = torch.empty_like(buf, device=builder.device(1))
    assert b.recv(a.self_id, landing).wait(WAIT_S) and send.wait(WAIT_S)
    assert torch.equal(landing.cpu(), buf.cpu())


@pytest.mark.parametrize(
    ("field", "peer_layout", "message_a", "message_b"),
    [
        ("block_size", KvLayout(2, 32, 2, 8, "float32"), "block_size: this worker has 16, the peer has 32",
         "block_size: this worker has 32, the peer has 16"),
        ("dtype", KvLayout(2, 16, 2, 8, "float16"), "dtype: this worker has float32, the peer has float16",
         "dtype: this worker has float16, the peer has float32"),
        ("kv_cache_dtype fp8", KvLayout(2, 16, 2, 8, "float8_e4m3fn"),
         "dtype: this worker has float32, the peer has float8_e4m3fn",
         "dtype: this worker has float8_e4m3fn, the peer has float32"),
    ],
)
def test_layout_mismatch_fails_pairing_on_both_sides(
    builder: Builder, field: str, peer_layout: KvLayout, message_a: str, message_b: str
) -> None:
    a, b = builder.make("prefill-0", index=0), builder.make("decode-0", layout=peer_layout, index=1)
    error_a, error_b = pair_both(a, b)
    assert isinstance(error_a, LayoutMismatchError) and message_a in str(error_a)
    assert isinstance(error_b, LayoutMismatchError) and message_b in str(error_b)
    assert not a.is_paired("decode-0") and not b.is_paired("prefill-0")
    with pytest.raises(ValueError, match="not paired"):
        a.send("decode-0", torch.zeros(4, device=builder.device(0)))


def test_recv_without_send_times_out_and_drop_is_prompt(builder: Builder) -> None:
    a, b = _paired(builder)
    landing = torch.empty(LAYOUT.buffer_shape(2), device=builder.device(1))
    pending = b.recv(a.self_id, landing)
    start = time.monotonic()
    assert pending.wait(0.2) is False and not pending.done()
    assert time.monotonic() - start < 0.5
    start = time.monotonic()
    b.drop(a.self_id)
    assert time.monotonic() - start < 0.05, "drop() must not block"
    assert not b.is_paired(a.self_id)
    with pytest.raises(TransferError, match="dropped"):
        pending.wait(WAIT_S)  # the dropped pair's unfinished transfers fail, they never hang
    b.drop(a.self_id)  # dropping twice is harmless


@pytest.mark.parametrize("builder", ["local", "gloo"], indirect=True)
def test_drop_fails_the_peers_pending_recv_quickly(builder: Builder) -> None:
    # NOTE: not NCCL: there the peer learns nothing until its own deadline (shared/gpu/README.md).
    a, b = _paired(builder)
    peer_pending = a.recv(b.self_id, torch.empty(LAYOUT.buffer_shape(1)))
    b.drop(a.self_id)
    with pytest.raises(TransferError):
        peer_pending.wait(2.0)


def test_the_same_ids_pair_again_after_a_drop(builder: Builder) -> None:
    a, b = _paired(builder)
    _move(builder, a, b, [0, 1], [1, 0])
    b.drop(a.self_id)  # one side only: a's pair() replaces its stale pair
    assert pair_both(a, b) == [None, None]
    _move(builder, a, b, [7, 8, 9], [20, 3, 12])
    a.drop(b.self_id)
    b.drop(a.self_id)
    assert pair_both(a, b) == [None, None]
    _move(builder, a, b, [31], [0])


def test_one_host_pairs_with_two_peers_at_once(builder: Builder) -> None:
    a, b, c = builder.make("prefill-0", index=0), builder.make("decode-0", index=1), builder.make("decode-1", index=1)
    results: dict[str, list[BaseException | None]] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p.self_id, pair_both(a, p)), daemon=True)
               for p in (b, c)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15.0)
    assert results == {"decode-0": [None, None], "decode-1": [None, None]}
    _move(builder, a, b, [1, 2], [3, 4])
    _move(builder, a, c, [5], [6])
    b.drop(a.self_id)  # pairs fail independently: a-c still moves data
    _move(builder, a, c, [7], [8])


def test_pairing_works_after_an_abandoned_attempt(builder: Builder) -> None:
    a, b = builder.make("prefill-0", index=0), builder.make("decode-0", index=1)
    with pytest.raises(TimeoutError):
        a.pair(b.self_id, a.address(), 0, 0.1)  # b never came
    with pytest.raises(TimeoutError):
        b.pair(a.self_id, a.address(), 1, 0.1)  # a never came
    assert pair_both(a, b) == [None, None]
    _move(builder, a, b, [0], [1])


@pytest.mark.parametrize("builder", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, _NEEDS_TWO_GPUS])],
                         indirect=True)
def test_a_peer_gone_after_the_handshake_fails_only_its_own_pairing(builder: Builder) -> None:
    """A joiner that passes the handshake and never builds the group (it died there) fails the host's
    pairing with it at the pairing's deadline, and meanwhile the host pairs with others."""
    host, other = builder.make("decode-0", index=1), builder.make("prefill-1", index=0)
    address = host.address()
    ghost_store = dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False,
                                timeout=timedelta(seconds=5))
    failures: list[BaseException] = []
    started = time.monotonic()

    def host_pairs_with_the_ghost() -> None:
        try:
            host.pair("prefill-0", address, 0, 3.0)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failures.append(e)

    thread = threading.Thread(target=host_pairs_with_the_ghost, daemon=True)
    thread.start()
    handshake(ghost_store, "decode-0", "prefill-0", 1, 3.0)  # ... and never builds its side
    time.sleep(0.2)  # the host is inside its group build now, waiting for the ghost
    assert thread.is_alive()
    assert pair_both(host, other, timeout_s=2.0) == [None, None]  # NOTE: shared store held: timed out here
    assert time.monotonic() - started < 2.8  # formed while the ghost's pairing still waited
    thread.join(5.0)
    assert not thread.is_alive() and time.monotonic() - started < 4.5  # at its 3 s deadline, not the group's 30 s
    assert len(failures) == 1 and isinstance(failures[0], TransferError)
    assert "did not build its side of the group" in str(failures[0])
    assert not host.is_paired("prefill-0")
    _move(builder, other, host, [3], [4])


def test_transfers_on_one_pair_keep_their_order(builder: Builder) -> None:
    a, b = _paired(builder)
    kv = builder.kv(0)
    bufs = [gather_blocks(kv, [i, i + 8]) for i in range(6)]  # 2 blocks each, all different
    sends = [a.send(b.self_id, buf) for buf in bufs]  # all sent before anything is received
    landings = [torch.empty_like(buf, device=builder.device(1)) for buf in bufs]
    recvs = [b.recv(a.self_id, landing) for landing in landings]
    assert all(h.wait(WAIT_S) for h in sends + recvs)
    for buf, landing in zip(bufs, landings):
        assert torch.equal(landing.cpu(), buf.cpu())


def test_transport_checks_its_arguments(builder: Builder) -> None:
    a, b = _paired(builder)
    with pytest.raises(ValueError, match="not paired with 'nobody'"):
        a.recv("nobody", torch.zeros(4, device=builder.device(0)))
    with pytest.raises(ValueError, match="contiguous"):
        a.send(b.self_id, torch.zeros(4, 4, device=builder.device(0)).t())
    with pytest.raises(ValueError, match="rank must be 0"):
        a.pair(b.self_id, a.address(), 2, 1.0)


def test_registry_names_the_known_and_the_capable_transports() -> None:
    assert {"local", "gloo", "nccl"} <= set(available_transports())
    with pytest.raises(ValueError,
                       match="unknown transport 'carrier-pigeon'; known transports: fault, gloo, local, nccl"):
        create_transport("carrier-pigeon", "w", LAYOUT, "cpu")
    with pytest.raises(ValueError, match="'nccl' cannot run on cpu tensors; transports that can: fault, gloo, local"):
        create_transport("nccl", "w", LAYOUT, "cpu")
    with pytest.raises(ValueError, match="'gloo' cannot run on cuda tensors; transports that can: fault, local, nccl"):
        create_transport("gloo", "w", LAYOUT, "cuda")


def test_pairing_times_out_when_the_peer_never_comes(builder: Builder) -> None:
    a = builder.make("prefill-0")
    address = a.address()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        a.pair("decode-0", address, 0, 0.3)
    assert time.monotonic() - start < 1.0
    assert not a.is_paired("decode-0")


class _FakeEvent:
    """Stands in for a torch.cuda.Event: completes when told to."""

    def __init__(self) -> None:
        self.is_complete = False

    def query(self) -> bool:
        return self.is_complete

    def elapsed_time(self, end: _FakeEvent) -> float:
        """Milliseconds from this event to `end`, as torch.cuda.Event says it."""
        return 2.0


def test_nccl_handle_polls_its_event_against_the_deadline_and_fails_once_dropped() -> None:
    # The NCCL handle's logic runs on the CPU with a fake event; the transport itself needs 2 GPUs.
    from kvtransfer.pair_group import Pair
    from kvtransfer.torch_dist import _CudaEventHandle

    pair = Pair("decode-0", rank=0, group=None)
    event = _FakeEvent()
    handle = _CudaEventHandle("recv from 'decode-0'", _FakeEvent(), event, pair, "prefill-0")  # type: ignore[arg-type]
    start = time.monotonic()
    assert handle.wait(0.1) is False and not handle.done()
    assert 0.1 <= time.monotonic() - start < 0.3
    assert handle.device_seconds() is None  # not done: not timed yet
    event.is_complete = True
    assert handle.done() and handle.wait(0.0) and handle.error is None
    assert handle.device_seconds() == 0.002  # the events' elapsed time, in seconds

    stuck = _CudaEventHandle("recv from 'decode-0'",
                             _FakeEvent(), _FakeEvent(), pair, "prefill-0")  # type: ignore[arg-type]
    pair.is_dropped = True
    assert stuck.done() and isinstance(stuck.error, TransferError)
    with pytest.raises(TransferError, match="dropped its pair"):
        stuck.wait(1.0)


def test_moves_fp8_blocks(builder: Builder) -> None:
    """An FP8 cache's blocks (kv_cache_dtype='fp8') move as their bytes, half of bfloat16's."""
    layout = KvLayout(2, 16, 2, 8, "float8_e4m3fn")
    a, b = builder.make("prefill-0", layout=layout, index=0), builder.make("decode-0", layout=layout, index=1)
    assert pair_both(a, b) == [None, None]
    kv_a = (torch.randn(2, 2, 8, 16, 2, 8) * 100).to(torch.float8_e4m3fn).to(builder.device(0))
    buf = gather_blocks(kv_a, [6, 2])
    landing = torch.empty_like(buf, device=builder.device(1))
    recv = b.recv(a.self_id, landing)
    assert a.send(b.self_id, buf).wait(WAIT_S) and recv.wait(WAIT_S) and recv.error is None
    assert landing.dtype == torch.float8_e4m3fn and landing.nbytes == buf.numel()
    assert torch.equal(landing.cpu().view(torch.uint8), kv_a[:, :, [6, 2]].cpu().view(torch.uint8))
