"""A Triton kernel launched every decode step without Triton's per-call binding.

Triton's launcher binds and specializes every argument and looks the compiled variant up at each call;
for the sampler's race that was about half its host time on an H200's host (17.7-27.1 against 9.2-13.8
us called directly: bench/results/sampling_step_*). `DirectLaunch` keeps the variant a key's first
launch compiled (or found) and calls it directly afterwards. Invariant: the caller's key holds
everything Triton specializes the kernel on: each pointer's dtype and whether it is 16-byte aligned,
the value of each integer argument that is specialized, every constexpr, the launch options, and the
device; arguments are passed positionally, constexprs included, in the kernel's order. Under Triton's
interpreter (no compiled variant) every launch takes the launcher. Imported by kernel modules only.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["DirectLaunch"]


class DirectLaunch:
    """Launches of one @triton.jit kernel, each key's variant called directly from its second launch on."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._variants: dict[Hashable, Any] = {}

    def forget(self) -> None:
        """Drops every key's variant, so the next launch of each goes through Triton's launcher again (a test
        that starts an engine as a process's first would, tests/gpu/test_compile_warmup_gpu.py)."""
        self._variants.clear()

    def __call__(self, key: Hashable, grid: tuple[int, int, int], *args: Any, **options: Any) -> None:
        variant = self._variants.get(key)
        if variant is None:
            # NOTE: the launcher's return is the compiled variant (None under the interpreter: False, kept)
            self._variants[key] = self._kernel[grid](*args, **options) or False
        elif variant is False:
            self._kernel[grid](*args, **options)
        else:
            variant[grid](*args)
