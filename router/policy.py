"""Dispatch policies: which prefill worker computes a prompt and which decode worker leases its KV.

`CacheAwarePolicy` (the default): a prefill worker by the longest prefix of the prompt it is
believed to hold in its prefix cache, then by queue depth; a decode worker with KV room by the
smallest running batch, then by free KV blocks. The router learns both without asking per request:

- prefix: `PrefixIndex` (router/prefix_index.py) holds, per worker, the full-block hashes its prefix
  cache reported (mirrored from the worker's journal: what every router replica sent it, less what it
  evicted) and those of prompts this router sent it since;
- load: `LoadTracker` refreshes every worker's `stats()` in the background, and the policy adds
  the requests this router assigned since the last refresh.

The Dispatcher takes any DispatchPolicy it is given (tests give their own).

Prefill rules (disaggregated mode) decide which prompts skip the prefill workers and are computed
by their decode worker itself: no lease, no KV push, two fewer hops, but the prompt's compute lands
in that worker's decode batch. `ShortOrCachedRule` (the default) skips for short prompts and for
prompts a decode worker is believed to hold mostly in its prefix cache (the Dispatcher gives policy
and rule one PrefixIndex); `RemotePrefillRule` never skips. They register by
name too (`register_prefill_rule`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.kv_cache import BlockHash
from protocol.api import WorkerStatsMsg
from router.prefix_index import PrefixIndex
from router.worker_refresh import WorkerRefresh


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    role: str = ""  # "prefill" or "decode" (a colocated worker reports "decode")
    num_queued_prompt_tokens: int = 0
    decode_step_s: float = 0.0  # 0.0: not measured yet (engine/step_rates.py)
    prefill_tokens_per_s: float = 0.0
    kv_bytes_per_token: int = 0
    push_bytes_per_s: float = 0.0  # a prefill worker's pushes so far (0.0: none yet)
    fetched_at: float = 0.0  # time.monotonic() when the stats call that reported this went out
    max_num_seqs: int = 0  # its running batch's cap (0: not reported)


class DispatchPolicy(Protocol):
    name: ClassVar[str]

    def prefill_order(self, prompt: Sequence[int], prefill_ids: Sequence[str]) -> list[str]:
        """Prefill workers to try, best first."""
        ...

    def decode_order(self, num_prompt_tokens: int, decode_ids: Sequence[str]) -> list[str]:
        """Decode workers to lease KV blocks on, best first."""
        ...

    def colocated_order(self, prompt: Sequence[int], worker_ids: Sequence[str]) -> list[str]:
        """Colocated workers to compute and decode `prompt`, best first."""
        ...

    def on_sent(self, worker_id: str, prompt: Sequence[int]) -> None:
        """`prompt` was sent to colocated worker `worker_id` to compute (before the call goes: requests
        arriving together must see it)."""
        ...

    def on_assigned(self, worker_id: str, prompt: Sequence[int] | None) -> None:
        """A request went to `worker_id` (a prefill worker when `prompt` is given)."""
        ...

    def on_prompt(self, worker_id: str, prompt: Sequence[int]) -> None:
        """`prompt` was sent to prefill (or colocated) worker `worker_id` (its blocks will be cached
        there); the Dispatcher tells this after the call has gone, so hashing the prompt costs no latency."""
        ...

    def on_finished(self, worker_id: str) -> None: ...


class LoadTracker(WorkerRefresh):
    """The workers' last reported load, refreshed every `interval_s` by one stats() call each."""

    def __init__(self, fetch: Callable[[str], Awaitable[WorkerStatsMsg]], interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(interval_s)
        self.fetch = fetch
        self.clock = clock
        self.loads: dict[str, WorkerLoad] = {}

    def _forget_all_but(self, kept: set[str]) -> None:
        for gone in set(self.loads) - kept:
            del self.loads[gone]

    async def refresh(self) -> None:
        fetched_at = self.clock()
        for worker_id, row in await self._ask_each(self.fetch):
            if isinstance(row, WorkerStatsMsg) and worker_id in self.worker_ids:
                push = row.push_totals
                self.loads[worker_id] = WorkerLoad(
                    worker_id, row.num_running, row.num_waiting, row.num_free_blocks, row.num_blocks, row.role,
                    row.num_queued_prompt_tokens, row.decode_step_s, row.prefill_tokens_per_s, row.kv_bytes_per_token,
                    push.push_bytes / push.push_seconds if push.push_seconds > 0 else 0.0, fetched_at,
                    row.max_num_seqs,
                )


class SentSinceReport:
    """Prompt tokens this router sent each worker to compute since that worker's last report was asked
    for (WorkerLoad.fetched_at): added to the report's queue, requests that arrive between two reports
    see each other instead of one stale queue."""

    MAX_PER_WORKER = 10_000  # prompts remembered per worker between its reports (bounds a silent worker's)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # NOTE: the LoadTracker's: fetched_at is compared with it
        self._sent: dict[str, deque[tuple[float, int]]] = {}  # worker id -> (when, prompt tokens)
        self._totals: dict[str, int] = {}  # worker id -> the sum of its deque's tokens (a burst reads it in O(1))

    def add(self, worker_id: str, num_tokens: int) -> None:
        sent = self._sent.get(worker_id)
        if sent is None:
            sent = self._sent[worker_id] = deque()
            self._totals[worker_id] = 0
        if len(sent) == self.MAX_PER_WORKER:
            self._totals[worker_id] -= sent.popleft()[1]
        sent.append((self.clock(), num_tokens))
        self._totals[worker_id] += num_tokens

    def queued_tokens(self, load: WorkerLoad) -> int:
        """The prompt tokens queued at a worker: its last report and what was sent since it was asked for."""
        sent = self._sent.get(load.worker_id)
        if not sent:
            return load.num_queued_prompt_tokens
        while sent and sent[0][0] < load.fetched_at:
            self._totals[load.worker_id] -= sent.popleft()[1]
        return load.num_queued_prompt_tokens + self._totals[load.worker_id]

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)
        self._totals.pop(worker_id, None)


class CacheAwarePolicy:
    name: ClassVar[str] = "cache_aware"

    def __init__(
        self, block_size: int = 16, loads: Mapping[str, WorkerLoad] | None = None, min_free_fraction: float = 0.05,
        clock: Callable[[], float] = time.monotonic, prefix: PrefixIndex | None = None, **_: Any,
    ) -> None:
        self.prefix = prefix if prefix is not None else PrefixIndex(block_size)
        self.sent = SentSinceReport(clock)
        self.min_free_fraction = min_free_fraction
        # NOTE: prefill_order and on_assigned see the same prompt one after the other: hash it once.
        self._hashed: tuple[Sequence[int], list[BlockHash]] | None = None
        self.loads: Mapping[str, WorkerLoad] = loads if loads is not None else {}
        self.assigned: dict[str, int] = {}  # requests this router sent since they last finished
        # NOTE: one rotation per kind: requests that arrive together see the same loads, and
        # ties must still spread them.
        self._prefill_tie = itertools.count()
        self._decode_tie = itertools.count()

    def _hashes(self, prompt: Sequence[int]) -> list[BlockHash]:
        if self._hashed is None or self._hashed[0] is not prompt:
            self._hashed = (prompt, self.prefix.hashes(prompt))
        return self._hashed[1]

    def prefill_order(self, prompt: Sequence[int], prefill_ids: Sequence[str]) -> list[str]:
        if len(prefill_ids) <= 1:
            return list(prefill_ids)  # NOTE: nothing to choose: the prompt is not hashed before its call
        hashes = self._hashes(prompt)
        tie = next(self._prefill_tie)

        def key(i_id: tuple[int, str]) -> tuple[int, int, int]:
            i, worker_id = i_id
            load = self.loads.get(worker_id, WorkerLoad(worker_id))
            queue = load.num_waiting + load.num_running + self.assigned.get(worker_id, 0)
            return (-self.prefix.match_blocks(worker_id, hashes), queue, (i - tie) % len(prefill_ids))

        return [w for _, w in sorted(enumerate(prefill_ids), key=key)]

    def decode_order(self, num_prompt_tokens: int, decode_ids: Sequence[str]) -> list[str]:
        """Workers with KV room first (over `min_free_fraction` of their blocks free, or not yet
        reported), then the smallest running batch (its own plus what this router sent since),
        then the most free blocks."""
        tie = next(self._decode_tie)

        def key(i_id: tuple[int, str]) -> tuple[bool, int, int, int]:
            i, worker_id = i_id
            load = self.loads.get(worker_id, WorkerLoad(worker_id))
            has_room = load.num_blocks == 0 or load.num_free_blocks > self.min_free_fraction * load.num_blocks
            batch = load.num_running + load.num_waiting + self.assigned.get(worker_id, 0)
            return (not has_room, batch, -load.num_free_blocks, (i - tie) % len(decode_ids))

        return [w for _, w in sorted(enumerate(decode_ids), key=key)]

    def colocated_order(self, prompt: Sequence[int], worker_ids: Sequence[str]) -> list[str]:
        """Workers with KV room first, then the fewest prompt tokens to compute before this prompt's
        first token there (their queue, with what this router sent since it was reported, and the part
        of this prompt their prefix cache is believed not to hold), then the smallest running batch,
        then the most free blocks. Prompts of 1,000 to 4,000 tokens make counts of requests a poor
        measure of the wait."""
        tie = next(self._decode_tie)
        hashes = self._hashes(prompt) if len(worker_ids) > 1 else []
        block_size = self.prefix.block_size

        def key(i_id: tuple[int, str]) -> tuple[bool, int, int, int, int]:
            i, worker_id = i_id
            load = self.loads.get(worker_id, WorkerLoad(worker_id))
            has_room = load.num_blocks == 0 or load.num_free_blocks > self.min_free_fraction * load.num_blocks
            uncached = len(prompt) - self.prefix.match_blocks(worker_id, hashes) * block_size if hashes else 0
            batch = load.num_running + load.num_waiting + self.assigned.get(worker_id, 0)
            return (not has_room, self.sent.queued_tokens(load) + uncached, batch, -load.num_free_blocks,
                    (i - tie) % len(worker_ids))

        return [w for _, w in sorted(enumerate(worker_ids), key=key)]

    def on_sent(self, worker_id: str, prompt: Sequence[int]) -> None:
        # NOTE: colocated_order hashed the prompt if there was a choice; with none, nothing is matched
        hashed = self._hashed is not None and self._hashed[0] is prompt
        matched = self.prefix.match_blocks(worker_id, self._hashed[1]) * self.prefix.block_size if hashed else 0
        self.sent.add(worker_id, len(prompt) - matched)

    def on_assigned(self, worker_id: str, prompt: Sequence[int] | None) -> None:
        self.assigned[worker_id] = self.assigned.get(worker_id, 0) + 1
        if prompt is not None:
            self.on_prompt(worker_id, prompt)

    def on_prompt(self, worker_id: str, prompt: Sequence[int]) -> None:
        self.prefix.add(worker_id, self._hashes(prompt))

    def on_finished(self, worker_id: str) -> None:
        if self.assigned.get(worker_id, 0) > 0:
            self.assigned[worker_id] -= 1



class PrefillRule(Protocol):
    """Disaggregated mode: which prompts their decode worker prefills itself (no prefill worker)."""

    name: ClassVar[str]

    def local_workers(self, prompt: Sequence[int], decode_ids: Sequence[str]) -> tuple[list[str], int]:
        """The decode workers of `decode_ids` that should compute `prompt` themselves (empty: a
        prefill worker computes it), and the fewest leading prompt tokens one must hold in its
        prefix cache to take it (0: no condition; the worker checks, and declines if not)."""
        ...

    def on_cached(self, decode_id: str, token_ids: Sequence[int]) -> None:
        """The KV of `token_ids` was computed on, or pushed into, `decode_id`."""
        ...

    def forget(self, decode_id: str) -> None:
        """`decode_id` left: nothing of it is cached any more."""
        ...


_PREFILL_RULES: dict[str, Callable[..., PrefillRule]] = {}


def register_prefill_rule(cls: type) -> type:
    _PREFILL_RULES[cls.name] = cls
    return cls


def prefill_rule_names() -> list[str]:
    return sorted(_PREFILL_RULES)


def create_prefill_rule(name: str, **kwargs: Any) -> PrefillRule:
    if name not in _PREFILL_RULES:
        raise ValueError(f"prefill rule {name!r} is unknown; known: {', '.join(prefill_rule_names())}")
    return _PREFILL_RULES[name](**kwargs)


@register_prefill_rule
class RemotePrefillRule:
    """Every prompt goes through a prefill worker (pdserve before prefill rules existed)."""

    name: ClassVar[str] = "remote"

    def __init__(self, **_: Any) -> None:
        pass

    def local_workers(self, prompt: Sequence[int], decode_ids: Sequence[str]) -> tuple[list[str], int]:
        return [], 0

    def on_cached(self, decode_id: str, token_ids: Sequence[int]) -> None:
        pass

    def forget(self, decode_id: str) -> None:
        pass


@register_prefill_rule
class ShortOrCachedRule:
    """A prompt of fewer than `max_short_prompt_tokens` tokens goes to any decode worker (the
    dispatch policy picks which); a longer one to the decode workers believed to hold at least
    `min_cached_fraction` of it in their prefix cache (the worker checks, and declines if not)."""

    name: ClassVar[str] = "short_or_cached"

    def __init__(
        self, max_short_prompt_tokens: int = 0, min_cached_fraction: float = 1.0, block_size: int = 16,
        max_blocks: int = 100_000, prefix: PrefixIndex | None = None, **_: Any,
    ) -> None:
        self.max_short_prompt_tokens = max_short_prompt_tokens
        self.min_cached_fraction = min_cached_fraction
        self.prefix = prefix if prefix is not None else PrefixIndex(block_size, max_blocks)

    def local_workers(self, prompt: Sequence[int], decode_ids: Sequence[str]) -> tuple[list[str], int]:
        if len(prompt) < self.max_short_prompt_tokens:
            return list(decode_ids), 0
        min_cached_tokens = math.ceil(self.min_cached_fraction * len(prompt))
        if min_cached_tokens > len(prompt) - 1:  # NOTE: a prompt's last token is always computed
            return [], 0
        matches = self.prefix.longest_matches(prompt, decode_ids)
        block_size = self.prefix.block_size
        return [w for w in decode_ids if matches[w] * block_size >= min_cached_tokens], min_cached_tokens

    def on_cached(self, decode_id: str, token_ids: Sequence[int]) -> None:
        self.prefix.add(decode_id, self.prefix.hashes(token_ids))

    def forget(self, decode_id: str) -> None:
        self.prefix.forget(decode_id)


@register_prefill_rule
class SloRule(ShortOrCachedRule):
    """Conditional disaggregation per request, against the TPOT SLO (and the TTFT it predicts): the
    prompt goes where its first token comes sooner.

    remote  (prompt tokens queued at the prefill worker + this prompt) / its prefill rate
            + the push (the prompt's KV bytes / the worker's measured push bandwidth);
    local   a decode worker prefills in chunks alongside its running batch within the engines' step
            budget `step_s` (SloConfig.step_budget_ms: a share of the TPOT SLO): each step may add
            (step_s - its decode step time) x its prefill rate prompt tokens, so (its queued prompt
            tokens + the uncached part of this prompt) / that chunk steps, each step_s long. A worker
            whose decode step alone exceeds the budget cannot take it, nor one whose batch is full
            (running and waiting at max_num_seqs): its prompt would wait for a sequence to end
            before its first token, where a prompt prefilled remotely waits after it, inside TPOT.
    The decode workers whose local estimate beats the best remote one are returned, soonest first.
    A worker's queue is its last report plus the prompt tokens this rule sent it since that report
    was asked for (requests arriving together would otherwise all see the same queue and go one
    way); a prompt sent remote is counted at the prefill worker with the soonest estimate. A decode
    worker that never prefilled (all went remote) has no prefill rate of its own: the fastest measured
    one stands for it, or it would never be chosen and never measure one.
    Until a side has measured its speed (a fresh cluster), short_or_cached decides.
    """

    name: ClassVar[str] = "slo"

    def __init__(self, loads: Mapping[str, WorkerLoad] | None = None, step_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loads: Mapping[str, WorkerLoad] = loads if loads is not None else {}
        if step_s is None or step_s <= 0:
            raise ValueError("the 'slo' prefill rule needs a TPOT SLO (slo.tpot_ms, --slo-tpot-ms)")
        self.step_s = step_s
        self.sent = SentSinceReport(clock)

    def queued_tokens(self, load: WorkerLoad) -> int:
        return self.sent.queued_tokens(load)

    def _remote(self, num_tokens: int) -> tuple[float, str] | None:
        """The soonest first token through a prefill worker, and which (None: none has measured its speed)."""
        best = None
        for load in self.loads.values():
            if load.role != "prefill" or load.prefill_tokens_per_s <= 0:
                continue
            push = (num_tokens * load.kv_bytes_per_token / load.push_bytes_per_s) if load.push_bytes_per_s > 0 else 0.0
            ttft = (self.queued_tokens(load) + num_tokens) / load.prefill_tokens_per_s + push
            if best is None or ttft < best[0]:
                best = (ttft, load.worker_id)
        return best

    def remote_ttft_s(self, num_tokens: int) -> float | None:
        best = self._remote(num_tokens)
        return None if best is None else best[0]

    def prefill_rate(self, load: WorkerLoad) -> float:
        """A worker's prefill rate: its own measure, or (a decode worker that has not prefilled yet, so
        never measured it) the fastest measured by any worker, serving the same model; 0.0: none yet."""
        if load.prefill_tokens_per_s > 0:
            return load.prefill_tokens_per_s
        return max((w.prefill_tokens_per_s for w in self.loads.values()), default=0.0)

    def local_ttft_s(self, decode_id: str, num_uncached: int) -> float | None:
        """A decode worker's first token when it prefills alongside its batch within the step budget
        (inf: its decode step alone breaks the budget, or its batch is full; None: not measured yet)."""
        load = self.loads.get(decode_id)
        rate = self.prefill_rate(load) if load is not None else 0.0
        if load is None or rate <= 0 or (load.num_running and load.decode_step_s <= 0):
            return None
        if load.max_num_seqs and load.num_running + load.num_waiting >= load.max_num_seqs:
            return math.inf
        room_s = self.step_s - (load.decode_step_s if load.num_running else 0.0)
        if room_s <= 0:
            return math.inf
        chunk = room_s * rate  # prompt tokens a step may add
        return math.ceil((self.queued_tokens(load) + num_uncached) / chunk) * self.step_s

    def local_workers(self, prompt: Sequence[int], decode_ids: Sequence[str]) -> tuple[list[str], int]:
        remote = self._remote(len(prompt))
        uncached = {d: len(prompt) - m * self.prefix.block_size
                    for d, m in self.prefix.longest_matches(prompt, decode_ids).items()}
        local = {d: self.local_ttft_s(d, uncached[d]) for d in decode_ids}
        if remote is None or any(v is None for v in local.values()):
            return super().local_workers(prompt, decode_ids)
        better = sorted((t, d) for d, t in local.items() if t is not None and t <= remote[0])
        if better:
            self.sent.add(better[0][1], uncached[better[0][1]])
        else:
            self.sent.add(remote[1], len(prompt))
        return [d for _, d in better], 0

    def forget(self, decode_id: str) -> None:
        super().forget(decode_id)
        self.sent.forget(decode_id)
