"""What the planner knows of one GPU running the model: the time of a prefill step by the prompt
tokens it computes, and of a decode step by batch and mean context, measured or synthetic.

Times between the measured points are interpolated linearly, and past the last point extrapolated
along the last segment (a step's time grows about linearly with its tokens and its KV reads).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points, extrapolated along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class StepProfile(BaseModel):
    """One worker's step times (a worker of tensor_parallel_size GPUs). JSON: what `pdserve plan
    --profile` reads, one file per worker size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_tokens: tuple[int, ...] = Field(min_length=1, description="Prompt tokens of a prefill step, ascending.")
    prefill_ms: tuple[float, ...] = Field(min_length=1, description="Its time, one per prefill_tokens.")
    decode_batches: tuple[int, ...] = Field(min_length=1, description="Sequences of a decode step, ascending.")
    decode_contexts: tuple[int, ...] = Field(min_length=1, description="Their mean context in tokens, ascending.")
    decode_ms: tuple[tuple[float, ...], ...] = Field(
        min_length=1, description="A decode step's time: decode_ms[b][c] for decode_batches[b], decode_contexts[c]."
    )
    push_ms_per_token: float = Field(0.0, ge=0.0, description="Disaggregated: the KV push, per prompt token.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences one worker runs at once.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="A colocated step's token budget.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs of the worker these times were measured on.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        for name, xs in (("prefill_tokens", self.prefill_tokens), ("decode_batches", self.decode_batches),
                         ("decode_contexts", self.decode_contexts)):
            if list(xs) != sorted(set(xs)):
                raise ValueError(f"{name} must be strictly ascending; got {list(xs)}")
        if len(self.prefill_ms) != len(self.prefill_tokens):
            raise ValueError(f"prefill_ms has {len(self.prefill_ms)} times for {len(self.prefill_tokens)} lengths")
        if len(self.decode_ms) != len(self.decode_batches) or any(
            len(row) != len(self.decode_contexts) for row in self.decode_ms
        ):
            raise ValueError(f"decode_ms must be [{len(self.decode_batches)} batches][{len(self.decode_contexts)} "
                             "contexts]")
        return self

    def prefill_step_ms(self, tokens: int) -> float:
        """Interpolated; a profile of one prefill length scales it in proportion (a constant would make
        every prompt, however long, cost that one step)."""
        if tokens <= 0:
            return 0.0
        if len(self.prefill_tokens) == 1:
            return self.prefill_ms[0] * tokens / self.prefill_tokens[0]
        return _interpolate(self.prefill_tokens, self.prefill_ms, tokens)

    def decode_step_ms(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        by_batch = [_interpolate(self.decode_contexts, row, context) for row in self.decode_ms]
        return _interpolate(self.decode_batches, by_batch, batch)
