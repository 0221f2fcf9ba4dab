"""What the planner knows of one GPU running the model: the time of a prefill step by the prompt
tokens it computes, and of a decode step by batch and mean context, measured or synthetic.

Times between the measured points are interpolated linearly, and past the last point extrapolated
along the last segment (a step's time grows about linearly with its tokens and its KV reads).

A chunk of a prompt that already has `context` tokens in the cache also attends to them: that costs
its tokens x context x the attention time of one (query, key) pair, which the profile's prefill
points give (a prompt of L tokens alone attends to L^2 / 2 pairs: its time is fitted as a + b L +
alpha L^2 / 2). Measured on one H200 at the Llama-3.1-8B shape (bench/results/prefill_queue_*), a
queue of prompts of 1,000-4,000 tokens in 2,048-token chunks took 1.063-1.074x what the chunks'
fresh-prompt times sum to; the context term predicts 1.059x.
"""

from __future__ import annotations

import bisect
from functools import lru_cache
from collections.abc import Sequence
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through the points, extrapolated along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return y if y > 0.0 else 0.0  # NOTE: max(0.0, y), without the call (the planner's simulation's hot path)


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

    @property
    def context_ms_per_pair(self) -> float:
        """Milliseconds of attention a (query, key) pair: alpha of the least-squares fit of the prefill
        points to a + b L + alpha L^2 / 2; 0 with fewer than three points or a negative fit."""
        return _pair_ms(self.prefill_tokens, self.prefill_ms)

    def prefill_chunk_ms(self, tokens: int, context: int) -> float:
        """A chunk of `tokens` prompt tokens after `context` of its prompt already in the cache."""
        if tokens <= 0:
            return 0.0
        return self.prefill_step_ms(tokens) + self.context_ms_per_pair * tokens * context

    def prompt_ms(self, tokens: int) -> float:
        """A prompt of `tokens` computed alone, in chunks of at most max_num_batched_tokens."""
        alpha, total, done = self.context_ms_per_pair, 0.0, 0
        while done < tokens:
            chunk = min(self.max_num_batched_tokens, tokens - done)
            total += self.prefill_step_ms(chunk) + alpha * chunk * done
            done += chunk
        return total

    def decode_step_ms(self, batch: int, context: float) -> float:
        """Interpolated over the contexts in the two batch rows around `batch`, then between them (the
        rows the batch interpolation reads). The planner's simulation calls this once a simulated
        step: the three interpolations are _interpolate's, inlined, sharing one search of the contexts
        (the rows share them) and the batch's rows looked up once a batch size; the same numbers."""
        if batch <= 0:
            return 0.0
        contexts = self.decode_contexts
        rows = self._batch_rows(batch)
        if len(contexts) == 1:
            ya, yb = rows[2][0], rows[3][0]
        else:
            j = bisect.bisect_right(contexts, context)
            j = 1 if j < 1 else len(contexts) - 1 if j > len(contexts) - 1 else j
            x0, x1 = contexts[j - 1], contexts[j]
            ra, rb = rows[2], rows[3]
            ya = ra[j - 1] + (ra[j] - ra[j - 1]) * (context - x0) / (x1 - x0)
            yb = rb[j - 1] + (rb[j] - rb[j - 1]) * (context - x0) / (x1 - x0)
            ya, yb = (ya if ya > 0.0 else 0.0), (yb if yb > 0.0 else 0.0)
        b0, b1 = rows[0], rows[1]
        if b0 == b1:  # one batch row
            return ya
        y = ya + (yb - ya) * (batch - b0) / (b1 - b0)
        return y if y > 0.0 else 0.0

    def _batch_rows(self, batch: int) -> tuple[int, int, tuple[float, ...], tuple[float, ...]]:
        """(batch row below, batch row above, their times by context) for `batch`, as decode_step_ms's
        interpolation picks them; cached per batch size beside the fields it read (a copy with other
        fields starts a new cache; pydantic's equality and dumps ignore it)."""
        state = self.__dict__.get("_rows_by_batch")
        if state is None or state[0] is not self.decode_batches or state[1] is not self.decode_ms:
            state = (self.decode_batches, self.decode_ms, {})
            self.__dict__["_rows_by_batch"] = state
        found = state[2].get(batch)
        if found is None:
            batches, rows = self.decode_batches, self.decode_ms
            if len(batches) == 1:
                found = (batches[0], batches[0], rows[0], rows[0])
            else:
                i = min(max(bisect.bisect_right(batches, batch), 1), len(batches) - 1)
                found = (batches[i - 1], batches[i], rows[i - 1], rows[i])
            state[2][batch] = found
        return found


@lru_cache(maxsize=64)
def _pair_ms(prefill_tokens: tuple[int, ...], prefill_ms: tuple[float, ...]) -> float:
    """StepProfile.context_ms_per_pair, fitted once per set of points (the simulation asks per request)."""
    if len(prefill_tokens) < 3:
        return 0.0
    rows = [(1.0, float(n), n * n / 2.0) for n in prefill_tokens]
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    rhs = [sum(r[i] * t for r, t in zip(rows, prefill_ms)) for i in range(3)]
    return max(0.0, _solve3(normal, rhs)[2])


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a 3 x 3 system (Gaussian elimination, partial pivoting); zeros if singular."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-30:
            return [0.0, 0.0, 0.0]
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][3] / m[i][i] for i in range(3)]
