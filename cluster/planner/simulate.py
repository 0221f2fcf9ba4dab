"""Each request's TTFT and TPOT under one layout, by simulating the workers' steps from a profile.

- Colocated replica: continuous batching with chunked prefill. A step carries every running
  sequence's decode token and, in what is left of max_num_batched_tokens, chunks of waiting prompts
  in arrival order; it takes decode_step_ms(running) + prefill_step_ms(chunk tokens) + each chunk's
  attention to its prompt's earlier chunks (StepProfile.prefill_chunk_ms). A prompt's last chunk
  gives its first token.
- Disaggregated: a prefill pool serving prompts in arrival order, each on the worker that frees
  first, one prompt at a time in chunks of the step budget (StepProfile.prompt_ms; the first token
  comes from there), then the KV push, then a decode worker's continuous batch, whose steps take
  decode_step_ms(running).

Requests go to colocated replicas and decode workers in turn. TPOT is (last token - first token) /
(output - 1), so a request's wait for its decode worker counts against it, as a client sees it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cluster.planner.profile import StepProfile
from cluster.planner.workload import Request


class Layout(NamedTuple):
    num_prefill: int  # 0: colocated
    num_decode: int  # or colocated replicas
    prefill_tp: int = 1  # GPUs per prefill worker
    decode_tp: int = 1  # GPUs per decode (or colocated) worker

    @property
    def name(self) -> str:
        def tp(n: int) -> str:
            return f"(TP{n})" if n > 1 else ""

        if self.num_prefill == 0:
            return f"{self.num_decode} colocated{' TP' + str(self.decode_tp) if self.decode_tp > 1 else ''}"
        return f"{self.num_prefill}P{tp(self.prefill_tp)}{self.num_decode}D{tp(self.decode_tp)}"

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp


Profiles = Mapping[int, StepProfile]  # by the worker size (tensor_parallel_size) each was measured on


def by_size(profiles: StepProfile | Profiles) -> Profiles:
    return {profiles.tensor_parallel_size: profiles} if isinstance(profiles, StepProfile) else profiles


class Timing(NamedTuple):
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class _Seq:
    """A sequence as it joins a worker's running batch."""

    index: int
    first_token_s: float
    tokens_left: int  # decode tokens to come
    context: int


def simulate(layout: Layout, profiles: StepProfile | Profiles, reqs: Sequence[Request]) -> list[Timing]:
    """profiles: one per worker size the layout uses (a single profile: its own size)."""
    sizes = by_size(profiles)
    missing = sorted({layout.decode_tp, *([layout.prefill_tp] if layout.num_prefill else [])} - set(sizes))
    if missing:
        raise ValueError(f"layout {layout.name} needs a profile of workers of {missing[0]} GPUs; have {sorted(sizes)}")
    if layout.num_prefill == 0:
        return _colocated(layout.num_decode, sizes[layout.decode_tp], reqs)
    return _disaggregated(layout, sizes[layout.prefill_tp], sizes[layout.decode_tp], reqs)


def _colocated(num_replicas: int, profile: StepProfile, reqs: Sequence[Request]) -> list[Timing]:
    timings: list[Timing | None] = [None] * len(reqs)
    for replica in range(num_replicas):
        mine = [i for i in range(replica, len(reqs), num_replicas)]
        _run_colocated(profile, reqs, mine, timings)
    return timings  # type: ignore[return-value]


def _run_colocated(profile: StepProfile, reqs: Sequence[Request], mine: list[int], out: list[Timing | None]) -> None:
    alpha = profile.context_ms_per_pair
    arriving = deque(mine)
    waiting: deque[list[int]] = deque()  # [request index, prompt tokens left]
    running = _Running()
    t = 0.0
    while arriving or waiting or running.count:
        if not waiting and not running.count and reqs[arriving[0]].arrival_s > t:
            t = reqs[arriving[0]].arrival_s
        while arriving and reqs[arriving[0]].arrival_s <= t:
            i = arriving.popleft()
            waiting.append([i, reqs[i].prompt])
        budget = profile.max_num_batched_tokens - running.count
        chunks: list[tuple[list[int], int]] = []
        for item in waiting:
            if budget <= 0 or running.count + len(chunks) >= profile.max_num_seqs:
                break
            take = min(item[1], budget)
            chunks.append((item, take))
            budget -= take
        prefill_ms = profile.prefill_step_ms(sum(c for _, c in chunks)) + alpha * sum(
            take * (reqs[item[0]].prompt - item[1]) for item, take in chunks)  # attention to earlier chunks
        t += (profile.decode_step_ms(running.count, running.mean_context()) + prefill_ms) / 1e3
        running.decoded(t, reqs, out)
        for item, take in chunks:
            item[1] -= take
            if item[1] == 0:
                waiting.remove(item)
                i = item[0]
                if reqs[i].output <= 1:
                    out[i] = Timing(t - reqs[i].arrival_s, 0.0)
                else:
                    running.add(_Seq(i, t, reqs[i].output - 1, reqs[i].prompt + 1))


class _Running:
    """A worker's running sequences, by the step each finishes at (a heap), with their count and the sum
    of their contexts (an int: their mean is what summing them each step gives). A step touches only
    the sequences it finishes."""

    __slots__ = ("steps", "finishing", "count", "total_context")

    def __init__(self) -> None:
        self.steps = 0  # steps decoded so far
        self.finishing: list[tuple[int, int, _Seq]] = []  # (the step it finishes at, its index, it)
        self.count = 0
        self.total_context = 0

    def add(self, seq: _Seq) -> None:
        heapq.heappush(self.finishing, (self.steps + seq.tokens_left, seq.index, seq))
        self.count += 1
        self.total_context += seq.context

    def mean_context(self) -> float:
        return self.total_context / self.count if self.count else 0.0

    def decoded(self, t: float, reqs: Sequence[Request], out: list[Timing | None]) -> None:
        """A step that ended at t gave each sequence a token; those done leave with their Timing."""
        self.steps += 1
        self.total_context += self.count
        while self.finishing and self.finishing[0][0] == self.steps:
            _, _, s = heapq.heappop(self.finishing)
            r = reqs[s.index]
            out[s.index] = Timing(s.first_token_s - r.arrival_s, (t - s.first_token_s) / (r.output - 1))
            self.count -= 1
            self.total_context -= s.context + s.tokens_left  # its context now: one more a step it ran


def _disaggregated(layout: Layout, profile: StepProfile, decode: StepProfile, reqs: Sequence[Request]) -> list[Timing]:
    """profile: the prefill workers'; decode: the decode workers'."""
    free = [0.0] * layout.num_prefill  # when each prefill worker is next free (a heap)
    ready: list[list[tuple[float, int, float]]] = [[] for _ in range(layout.num_decode)]
    timings: list[Timing | None] = [None] * len(reqs)
    for i, r in enumerate(reqs):
        start = max(heapq.heappop(free), r.arrival_s)
        first = start + profile.prompt_ms(r.prompt) / 1e3
        heapq.heappush(free, first)
        if r.output <= 1:
            timings[i] = Timing(first - r.arrival_s, 0.0)
            continue
        landed = first + profile.push_ms_per_token * r.prompt / 1e3
        ready[i % layout.num_decode].append((landed, i, first))
    for queue in ready:
        _run_decode(decode, reqs, sorted(queue), timings)
    return timings  # type: ignore[return-value]


def _run_decode(profile: StepProfile, reqs: Sequence[Request], queue: list[tuple[float, int, float]],
                out: list[Timing | None]) -> None:
    pending = deque(queue)
    running = _Running()
    t = 0.0
    while pending or running.count:
        if not running.count and pending[0][0] > t:
            t = pending[0][0]
        while pending and pending[0][0] <= t and running.count < profile.max_num_seqs:
            _, i, first = pending.popleft()
            running.add(_Seq(i, first, reqs[i].output - 1, reqs[i].prompt + 1))
        t += profile.decode_step_ms(running.count, running.mean_context()) / 1e3
        running.decoded(t, reqs, out)
