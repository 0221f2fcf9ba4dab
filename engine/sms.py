"""How many streaming multiprocessors a CUDA device has, asked once a device: the launch rules that size their
grids by it (attention's split plans and tiles, the 4-bit kernel's K split) read it here."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int | None:
    """The SMs of a CUDA device; None elsewhere (the CPU, where Triton's interpreter runs the kernels)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
