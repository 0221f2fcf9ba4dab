"""Builders for transport tests: one fixture per transport kind (local, gloo, and nccl on hosts with
two GPUs), pairing two workers from two threads of this process, and a leak check after each test:
every transport closed, and no waiter thread of ours left running."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from kvtransfer import KvLayout, LocalHub, Transport, create_transport

LAYOUT = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
NUM_BLOCKS = 32
PAIR_TIMEOUT_S = 15.0  # NOTE: generous: a TCPStore connect can stall 5 s on a slow DNS resolver (rendezvous.py)

_NEEDS_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl tests need 2 CUDA GPUs")
KINDS = ["local", "gloo", pytest.param("nccl", marks=[pytest.mark.gpu, _NEEDS_TWO_GPUS])]


@dataclass
class Builder:
    """Transports of one kind; worker i lives on device i (cuda:i for nccl, the CPU otherwise)."""

    kind: str
    hub: LocalHub = field(default_factory=LocalHub)
    built: list[Transport] = field(default_factory=list)

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index) if self.kind == "nccl" else torch.device("cpu")

    def make(self, self_id: str, layout: KvLayout = LAYOUT, index: int = 0) -> Transport:
        kwargs: dict[str, object] = {"hub": self.hub} if self.kind == "local" else {"max_transfer_s": 30.0}
        transport = create_transport(self.kind, self_id, layout, self.device(index), **kwargs)
        self.built.append(transport)
        return transport

    def kv(self, index: int, layout: KvLayout = LAYOUT, fill: str = "rand") -> torch.Tensor:
        shape = (layout.num_layers, 2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
        kv = torch.rand(shape) if fill == "rand" else torch.zeros(shape)
        return kv.to(device=self.device(index), dtype=layout.torch_dtype)


def pair_both(a: Transport, b: Transport, timeout_s: float = PAIR_TIMEOUT_S) -> list[BaseException | None]:
    """a.pair(rank 0, hosting) and b.pair(rank 1) at once, from two threads; each side's exception."""
    address = a.address()
    errors: list[BaseException | None] = [None, None]

    def run(i: int, side: Transport, peer: Transport) -> None:
        try:
            side.pair(peer.self_id, address, i, timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, s, p), daemon=True) for i, s, p in ((0, a, b), (1, b, a))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5.0)
        assert not thread.is_alive(), "pair() outlived its timeout"
    return errors


def _our_threads(kind: str) -> list[str]:
    # NCCL's abort may legitimately take long (shared/gpu/README.md point 4): only waiters count there.
    prefixes = ("kvtransfer-send", "kvtransfer-recv") if kind == "nccl" else ("kvtransfer-",)
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]


@pytest.fixture(params=KINDS)
def builder(request: pytest.FixtureRequest) -> Iterator[Builder]:
    built = Builder(request.param)
    yield built
    for transport in built.built:
        transport.close()
    deadline = time.monotonic() + 3.0
    while _our_threads(built.kind) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _our_threads(built.kind), f"transport threads still running after close: {_our_threads(built.kind)}"
