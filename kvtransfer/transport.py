"""The Transport interface every KV mover implements, its transfer handles, and the registry that
builds one by name.

A transport belongs to one worker (`self_id`) and one KV layout. It pairs with peers one at a time
(one communicator per pair, so pairs form and fail independently), then moves contiguous buffers
(see layout.gather_blocks) to and from a paired peer without ever blocking the calling thread.

Threads, by contract:
  pair()                      blocking; call it from a non-engine thread on both sides at once.
  send() / recv() / drop()    never block; safe from the engine thread.
  TransferHandle.wait(t)      blocks at most t seconds.

This module knows nothing about the blocks a transfer fills or who owns them (that is the
block-ownership protocol above it), nor about Ray.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from kvtransfer.layout import KvLayout

__all__ = [
    "PairAddress", "TransferError", "TransferHandle", "EventHandle", "Transport",
    "register_transport", "create_transport", "available_transports",
]


@dataclass(frozen=True)
class PairAddress:
    """Where peers rendezvous with a worker (the worker that hosts the pair's store)."""

    host: str
    port: int


class TransferError(RuntimeError):
    """A transfer did not complete: the pair was dropped, the peer died, or the buffers disagree."""


class TransferHandle(abc.ABC):
    """One send or recv in flight. Its buffer must not be touched until `done()` is True."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the transfer has finished, successfully or not. Never blocks."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> bool:
        """True once finished successfully, False if still running after `timeout_s` seconds.
        Raises TransferError if it failed. Never blocks longer than the timeout."""

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """Why the transfer failed, once done; None while running or after success."""

    def device_seconds(self) -> float | None:
        """Once done: how long the transfer ran on the device (CUDA events around it on its stream),
        from the moment its stream reached it; None where the transport does not time it."""
        return None


class EventHandle(TransferHandle):
    """A handle finished by another thread (a waiter thread, or the matching side in-process)."""

    def __init__(self, what: str) -> None:
        self._what = what  # e.g. "recv from decode-0", for error messages
        self._event = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        """Mark finished; the first call wins (a later one, e.g. from a drop, changes nothing)."""
        if self._event.is_set():
            return
        self._error = error
        self._event.set()  # NOTE: after _error is written, so a reader that sees the event sees it

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        if not self._event.wait(max(0.0, timeout_s)):
            return False
        if self._error is not None:
            raise TransferError(f"{self._what} failed: {self._error}") from self._error
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error if self._event.is_set() else None


def poll_until(is_done: Callable[[], bool], timeout_s: float, interval_s: float = 0.001) -> bool:
    """Poll `is_done` every `interval_s` until it is True or `timeout_s` has passed."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while not is_done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))
    return True


class Transport(abc.ABC):
    """Moves contiguous KV buffers between this worker and its paired peers.

    Subclasses set `name` and their capabilities; callers ask `supports_cpu`/`supports_cuda`
    rather than testing the name.
    """

    name: ClassVar[str]
    supports_cpu: ClassVar[bool]
    supports_cuda: ClassVar[bool]
    binds_network: ClassVar[bool] = False  # takes `host=`: the address peers reach it at

    def __init__(self, self_id: str, layout: KvLayout, device: torch.device | str) -> None:
        self.self_id = self_id
        self.layout = layout
        self.device = torch.device(device)

    @abc.abstractmethod
    def address(self) -> PairAddress:
        """Where peers rendezvous with this worker; the rendezvous point is created on first call."""

    @abc.abstractmethod
    def pair(self, peer_id: str, address: PairAddress, rank: int, timeout_s: float) -> None:
        """Form the pair with `peer_id`. Blocking; both sides call it at the same time: rank 0 is
        the side whose `address()` is `address`, rank 1 the other. Raises LayoutMismatchError on
        both sides if the layouts differ, TimeoutError if the peer does not show up in time."""

    @abc.abstractmethod
    def send(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        """Start sending a contiguous tensor to a paired peer. Never blocks."""

    @abc.abstractmethod
    def recv(self, peer_id: str, tensor: torch.Tensor) -> TransferHandle:
        """Start receiving the peer's next send into `tensor` (same shape and dtype). Never blocks."""

    @abc.abstractmethod
    def drop(self, peer_id: str) -> None:
        """Forget the pair; its unfinished transfers fail. Never blocks. Unknown peers are ignored."""

    @abc.abstractmethod
    def is_paired(self, peer_id: str) -> bool: ...

    @abc.abstractmethod
    def close(self, timeout_s: float = 2.0) -> None:
        """Drop every pair and release the rendezvous point; may wait up to `timeout_s` for the
        transport's own threads to finish (call it on shutdown, not from the engine loop). Idempotent."""

    def _check_rank(self, rank: int) -> None:
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (hosts the rendezvous) or 1 (joins it), got {rank}")

    def _check_tensor(self, peer_id: str, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device.type:
            raise ValueError(f"{self.name} transport of {self.self_id!r} is on {self.device}, "
                             f"but the tensor for {peer_id!r} is on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("transfers move contiguous buffers; gather blocks with gather_blocks() first")


_T = TypeVar("_T", bound=type[Transport])
_REGISTRY: dict[str, type[Transport]] = {}  # name -> class; filled by @register_transport at import


def register_transport(cls: _T) -> _T:
    """Class decorator: make `cls` buildable by `create_transport(cls.name, ...)`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a transport named {cls.name!r} is already registered ({_REGISTRY[cls.name]!r})")
    _REGISTRY[cls.name] = cls
    return cls


def binds_network(name: str) -> bool:
    """Whether the transport registered as `name` listens on a network address (takes `host=`)."""
    return name in _REGISTRY and _REGISTRY[name].binds_network


def transport_options(name: str, host: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The constructor options of transport `name`: `options`, plus `host` when it listens on one."""
    merged = dict(options or {})
    if binds_network(name):
        merged.setdefault("host", host)
    return merged


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def _can_run_on(cls: type[Transport], device: torch.device) -> bool:
    return (device.type == "cpu" and cls.supports_cpu) or (device.type == "cuda" and cls.supports_cuda)


def create_transport(name: str, self_id: str, layout: KvLayout, device: torch.device | str,
                     **kwargs: Any) -> Transport:
    """Build the transport registered as `name` for worker `self_id`; kwargs go to its constructor."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; known transports: {', '.join(available_transports())}")
    device = torch.device(device)
    cls = _REGISTRY[name]
    if not _can_run_on(cls, device):
        capable = [n for n in available_transports() if _can_run_on(_REGISTRY[n], device)]
        raise ValueError(f"transport {name!r} cannot run on {device.type} tensors; "
                         f"transports that can: {', '.join(capable) or 'none'}")
    return cls(self_id, layout, device, **kwargs)
