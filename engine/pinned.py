"""Small host<->device copies that do not make the host wait for the device's queued work.

A copy from or to pageable memory synchronizes: torch waits for everything queued on the stream
before it (a whole forward pass, in the engine's step). Through pinned host memory and
non_blocking, the copy is queued like a kernel instead. On the CPU both are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["Download", "HostStaging", "upload"]


def upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a tensor on device, queued behind the device's work; the host goes on at once.
    NOTE: torch's pinned-memory allocator keeps the host block until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Download:
    """A device tensor's values, copied to the host behind the work queued so far: `read()` waits
    for that work alone, not for what is queued after (a `.tolist()` of the device tensor would)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(tensor.device))

    def read(self) -> list:  # type: ignore[type-arg]
        if self._copied is None or self._host is None:
            return self._tensor.tolist()
        self._copied.synchronize()
        return self._host.tolist()


class HostStaging:
    """One growable host buffer of int64 values, pinned on CUDA, and its copy to the device.

    `host(n)` hands out the first n values to write (numpy view); `upload(n)` copies them to the
    device (CUDA: non_blocking, from pinned memory, so the host does not wait; CPU: a copy).
    NOTE: a non_blocking copy may still be reading the buffer when the next step wants to write
    it, so `host` first waits for the previous copy's event. That copy is queued right behind the
    step before it, whose tokens the host has read by then (with asynchronous scheduling too), so
    the wait is short when it is not a mere query.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._buffer = self._allocate(1 << 12)
        self._array = self._buffer.numpy()  # NOTE: the buffer's numpy view, made once (a view costs microseconds)
        self._copied = torch.cuda.Event() if self.is_cuda else None
        self._is_copy_pending = False

    def _allocate(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.long, pin_memory=self.is_cuda)

    def host(self, num_values: int) -> np.ndarray:
        """Writable view of the first num_values values (int64)."""
        if self._is_copy_pending:
            assert self._copied is not None
            self._copied.synchronize()  # NOTE: returns at once when the copy is done
            self._is_copy_pending = False
        if num_values > self._buffer.numel():
            # NOTE: the old buffer's pending copy finished above; pinned memory is freed safely.
            self._buffer = self._allocate(max(num_values, 2 * self._buffer.numel()))
            self._array = self._buffer.numpy()
        return self._array[:num_values]

    def upload(self, num_values: int) -> torch.Tensor:
        """The first num_values values as an int64 tensor on the device."""
        if not self.is_cuda:
            return self._buffer[:num_values].clone()
        assert self._copied is not None
        staged = self._buffer[:num_values].to(self.device, non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))
        self._is_copy_pending = True
        return staged
