"""The 64-bit keys of the sampler's draws, and the fused draw's rows on the device.

A seeded request's token at output position n takes its noise from `draw_seed(seed, n)` alone. The fused
draw (`sampling_kernels.race`) computes every row's key itself, as splitmix64(a ^ (b + step)) of its row's
(a, b) and the launch's step: a seeded row's a = `seed_mix(seed)` and b + step its output position, so its
key is `draw_seed`'s; an unseeded row's a is random (drawn from the shared generator when the rows were
staged) and b = 0, so each launch's step gives it a new key. `RaceRows` uploads the rows only when they
change (a new request, another temperature, a seeded row off its stride): a steady batch draws with no
copy at all, its step a kernel argument. Keys are Philox keys: distinct keys give unrelated noise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from engine.pinned import HostStaging

__all__ = ["RaceRows", "as_int64", "draw_seed", "seed_mix", "step_key"]

_MASK64 = (1 << 64) - 1
_UNSEEDED = 0x5851F42D4C957F2D
"""Mixed into `step_key`'s offset, so that its keys are not draw_seed's of the same two numbers."""
STEP_WRAP = 1 << 31
"""Steps run 0 .. STEP_WRAP - 1 (one int32 kernel argument, never retyped), then the rows are staged anew."""


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer (Steele et al., 2014): a bijection of 64-bit ints that scatters every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, output_position: int) -> int:
    """The torch seed (64 bits) of a seeded request's draws for the token at `output_position`.

    Neighbouring seeds and positions give unrelated streams. NOTE: torch's CPU generator keeps only
    the low 32 bits of a seed (CUDA's Philox keeps all 64): the mix spreads every input bit into them.
    """
    return _splitmix64(seed_mix(seed) ^ output_position)


@functools.lru_cache(maxsize=4096)
def seed_mix(seed: int) -> int:
    """A request's seed mixed once (a request draws with it every step)."""
    return _splitmix64(seed & _MASK64)


def as_int64(key: int) -> int:
    """A 64-bit key as the int64 with its bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def step_key(generator: torch.Generator | None, device: torch.device) -> int:
    """One 64-bit key drawn from `generator` (torch's default one of `device` when None) on the host:
    a CUDA generator's seed and Philox offset, the offset then advanced by one draw's 4 (no kernel,
    no wait); a CPU generator's next 62 random bits."""
    if generator is None:
        if device.type != "cuda":
            generator = torch.default_generator
        else:
            generator = torch.cuda.default_generators[device.index if device.index is not None
                                                       else torch.cuda.current_device()]
    if generator.device.type != "cuda":
        return int(torch.randint(0, 1 << 62, (1,), generator=generator))
    offset = generator.get_offset()
    generator.set_offset(offset + 4)
    return _splitmix64(seed_mix(generator.initial_seed()) ^ _splitmix64(offset ^ _UNSEEDED))


class RaceRows:
    """A fused draw's rows on the device as `sampling_kernels.race` takes them, int64 [3 * rows]: row r's a
    at 3r, b at 3r + 1, the float64 bits of its inverse temperature at 3r + 2 (the module's docstring says
    how a and b make the key); staged again, in one pinned non_blocking copy (`engine.pinned.HostStaging`),
    only when the rows change. NOTE: a launch's step must be used once: `next` hands out each in turn."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = HostStaging(device)
        self._step = 0
        self._signature: list[tuple[float, int | None, int]] = []
        self._rows: torch.Tensor | None = None

    def next(self, rows: Sequence[tuple[int | None, float, int]],
             generator: torch.Generator | None) -> tuple[torch.Tensor, int]:
        """rows: each row's (seed or None, temperature, output position) -> (the rows on the device,
        the step to launch them with). Unseeded random rows' a are drawn from `generator` (torch's default
        one of the device when None) when the rows are staged; a greedy row (temperature 0) is staged with
        1 / T = inf, which the race takes for its argmax, and draws nothing."""
        step = self._step
        signature = [(t, None, 0) if s is None else (t, s, p - step) for s, t, p in rows]
        if signature != self._signature or self._rows is None or step == 0:
            self._rows, self._signature = self._stage(signature, generator), signature
        self._step = (step + 1) % STEP_WRAP
        return self._rows, step

    def _stage(self, signature: list[tuple[float, int | None, int]], generator: torch.Generator | None) -> torch.Tensor:
        n = len(signature)
        host = self._staging.host(3 * n)
        host[0::3], host[1::3] = 0, 0
        if any(seed is None and t > 0 for t, seed, _ in signature):  # NOTE: a greedy row draws no key
            # NOTE: an array's int64 sums wrap (silently, unlike a scalar's), as 64-bit keys do
            base = np.int64(as_int64(step_key(generator, self.device)))
            host[0::3] = (np.arange(n, dtype=np.int64) * np.int64(as_int64(0x9E3779B97F4A7C15))) ^ base
        for i, (_, seed, offset) in enumerate(signature):
            if seed is not None:
                host[3 * i], host[3 * i + 1] = as_int64(seed_mix(seed)), offset
        host[2::3].view(np.float64)[:] = [1.0 / t if t > 0 else math.inf for t, _, _ in signature]
        return self._staging.upload(3 * n)
