"""Small host<->device copies that do not make the host wait for the device's queued work.

A copy from or to pageable memory synchronizes: torch waits for everything queued on the stream
before it (a whole forward pass, in the engine's step). Through pinned host memory and
non_blocking, the copy is queued like a kernel instead. On the CPU both are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Download", "upload"]


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
