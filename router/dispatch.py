"""Dispatcher: drives one request through the workers, streams its tokens back, and moves it to
other workers when the ones it is on fail.

Disaggregated: reserve a lease on a decode worker, then one call to a prefill worker with the
request and the lease -> first token (the prefill worker pushes the KV after answering) -> the
decode worker's token batches. Colocated: submit to one worker -> its token batches.
Disaggregated, a prompt the prefill rule picks (DispatcherConfig.local_prefill: a short one, or one
a decode worker mostly holds in its prefix cache) skips the prefill workers: its decode worker
computes it itself (`prefill_locally`) and streams its tokens as a colocated worker would; if no
such worker takes it (no room, less cached than believed), it goes through a prefill worker.
One poller task per decode worker fetches that worker's TokenBatchMsg for this router and fans
the outputs out to the requests' inboxes. Knows nothing of HTTP, text or Ray pools: it is handed
the workers' clients (protocol/clients.py: over Ray, the request channel, or in-process).

Faults. A request runs as a series of attempts, each placed on workers under its own id
(`<request id>`, then `<request id>#1`, `#2`...), so nothing a failed attempt's workers still send
can reach the new one. An attempt fails, and the next starts, when:

| what                                                      | seen as                                    |
|-----------------------------------------------------------|--------------------------------------------|
| its decode (or colocated) worker died or left the set     | its poll fails / `set_workers` drops it    |
| its prefill worker died, failed or did not answer in time | the prefill call raises / errs / times out |
| the KV push failed or missed its deadline                 | an error row on the decode worker's stream |
| its worker sent nothing for `stall_timeout_s`             | the stream's deadline                      |

The next attempt continues the stream where the client is: its prompt is the original prompt plus
every token already yielded, with max_tokens and min_tokens lowered by their count. Disaggregated,
the prefill worker's prefix cache still holds the prompt's blocks, so only the tail is computed
again; colocated, the new worker computes it all. The continuation meets the prefill rule afresh: a
request that was prefilled on its (now failed) decode worker may go through a prefill worker next,
or be computed whole by another decode worker. Nothing is lost or repeated: the client sees
only what this Dispatcher yielded, and the continuation starts right after it.

What a continuation preserves: greedy requests give exactly the tokens of a fault-free run (the
same model over the same tokens), and so do seeded requests: the attempt says how many tokens
were yielded before it (`num_prior_output_tokens`), and a seeded draw depends only on the seed and
the output position (engine/sampler.py). Penalties are preserved too: frequency and presence
penalties count the request's whole output, the yielded tokens at the end of the continuation's
prompt included (the count tells the engine where they start), and the repetition penalty counts
prompt and output alike. Logprobs are those of the new attempt's computation. Not preserved: the
draws of unseeded requests, which come from a worker's shared generator anyway.

Every wait has a deadline (DispatcherConfig); after `max_attempts` the client gets a
RequestFailedError naming the last failure, and NoCapacityError when no worker can take it. With no
prefill worker serving for max_capacity_wait_s (the last one died, or each failed a call within
failed_worker_cooldown_s), a decode worker that takes the prompt computes it itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import SamplingParams
from engine.validation import InvalidRequestError
from protocol.api import CacheDeltaMsg, WorkerStatsMsg
from protocol.clients import DecodeClient, PrefillClient, WorkerClient
from router.policy import (
    CacheAwarePolicy,
    DispatchPolicy,
    LoadTracker,
    PrefillRule,
    create_prefill_rule,
    prefill_rule_names,
)
from router.prefix_index import CacheMirror, PrefixIndex
from protocol.messages import (
    GenerateRequestMsg,
    LeaseMsg,
    LocalPrefillMsg,
    PrefillResultMsg,
    PrefillTaskMsg,
    ReserveMsg,
    TokenOutputMsg,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C", bound=WorkerClient)


class NoCapacityError(RuntimeError):
    """Every decode worker is full: the caller should retry later (HTTP 503 with Retry-After)."""


class _NoPrefillWorker(NoCapacityError):
    """No prefill worker served within max_capacity_wait_s (none left, or each failed a call lately)."""


class RequestFailedError(RuntimeError):
    """A worker failed the request; the message says where and why."""


class LocalPrefillConfig(BaseModel):
    """Disaggregated mode: which requests skip the prefill workers, their decode worker computing
    the prompt itself (router.policy's prefill rules)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rule: str = Field(
        "short_or_cached",
        description="The prefill rule: 'short_or_cached' (short prompts, and prompts a decode worker mostly "
        "holds in its prefix cache), 'remote' (every prompt through a prefill worker), or 'slo' (where the first "
        "token comes sooner without breaking the TPOT SLO, from the workers' measured speed: router/policy.py).",
    )
    max_short_prompt_tokens: int = Field(
        192, ge=0, le=1 << 20,
        description="short_or_cached: prompts of fewer tokens are prefilled on their decode worker (0: none for "
        "being short). The default comes from `bench.skip_prefill` on CPUs with the default toy model "
        "(bench/results/skip_prefill_cpu.json); it has not been measured on a GPU.",
    )
    min_cached_fraction: float = Field(
        0.75, gt=0.0, lt=1.0,
        description="short_or_cached: a longer prompt is prefilled on a decode worker whose prefix cache holds at "
        "least this fraction of its tokens (as the router believes and the worker confirms).",
    )

    @field_validator("rule")
    @classmethod
    def _known_rule(cls, rule: str) -> str:
        if rule not in prefill_rule_names():
            raise ValueError(f"local_prefill.rule {rule!r} is unknown; known: {', '.join(prefill_rule_names())}")
        return rule


STEP_SHARE = 0.8
"""Of the TPOT SLO, what a step that adds prompt tokens may take. A request's TPOT is the mean of its
inter-token latencies and the SLO holds at p90: steps kept at the SLO itself would leave a request
that decodes beside a long run of chunked prompts no room for the measured step times' error."""


class SloConfig(BaseModel):
    """The service levels the router steers to (router.policy's 'slo' prefill rule reads them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_ms: float | None = Field(None, gt=0, description="Time to first token, p90 target (ms).")
    tpot_ms: float | None = Field(None, gt=0, description="Time per output token after the first, p90 target (ms).")

    @property
    def step_budget_ms(self) -> float | None:
        """The longest step that adds prompt tokens beside decoding requests on a decode worker (the
        disaggregated engines' SchedulerConfig.itl_budget_ms, and the step the 'slo' rule's local
        estimate counts): STEP_SHARE of the TPOT SLO. None without a TPOT SLO."""
        return None if self.tpot_ms is None else STEP_SHARE * self.tpot_ms


class DispatcherConfig(BaseModel):
    """Deadlines, retry limits and the prefill rule of the Dispatcher."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    load_refresh_s: float = Field(
        0.25, gt=0, description="How often the workers' load (queue depth, free KV blocks) is refreshed for dispatch."
    )
    max_attempts: int = Field(
        4, ge=1, le=32, description="Placements one request may use: the first, then migrations and retries."
    )
    max_capacity_wait_s: float = Field(
        2.0, ge=0.0, description="How long a request waits for a worker with room before NoCapacityError."
    )
    prefill_timeout_s: float = Field(
        120.0, gt=0.0, description="Longest wait for a prefill worker's answer (its queue, the prompt, the KV push)."
    )
    stall_timeout_s: float = Field(
        60.0, gt=0.0, description="An attempt whose worker sends nothing for this long is moved to another worker."
    )
    call_timeout_s: float = Field(
        10.0, gt=0.0, description="Longest wait for a control call (reserve, submit, abort), and a poll's grace."
    )
    failed_worker_cooldown_s: float = Field(
        10.0, ge=0.0, description="A worker whose call failed gets no new attempt for this long (or until it leaves)."
    )
    local_prefill: LocalPrefillConfig = Field(
        default_factory=LocalPrefillConfig,
        description="Disaggregated mode: which requests skip the prefill workers (prefilled on their decode worker).",
    )
    slo: SloConfig = Field(default_factory=SloConfig, description="The SLOs the router steers to.")

    @model_validator(mode="after")
    def _slo_rule_has_slos(self) -> DispatcherConfig:
        if self.local_prefill.rule == "slo" and self.slo.tpot_ms is None:
            raise ValueError("local_prefill.rule 'slo' needs slo.tpot_ms (pdserve serve --slo-tpot-ms)")
        return self


@dataclass(frozen=True)
class Workers:
    prefill: Mapping[str, PrefillClient]  # worker id -> its client; empty in colocated mode
    decode: Mapping[str, DecodeClient]  # worker id -> its client (colocated workers in colocated mode)

    @classmethod
    def of(cls, prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> Workers:
        """The set of these targets (Ray actor handles, or in-process workers), each in its kind's
        client; a client given is kept as it is."""
        return cls(prefill={i: t if isinstance(t, PrefillClient) else PrefillClient(i, t) for i, t in prefill.items()},
                   decode={i: t if isinstance(t, DecodeClient) else DecodeClient(i, t) for i, t in decode.items()})

    @property
    def is_colocated(self) -> bool:
        return not self.prefill


class _AttemptFailed(Exception):
    """This attempt cannot go on; the request may go on elsewhere."""


@dataclass(frozen=True)
class _WorkerLost:
    reason: str


@dataclass
class _Attempt:
    request: GenerateRequestMsg  # as the workers see it: the attempt's id and the continuation prompt
    # What its worker sent and _next has not taken, oldest first; `arrived` is set by every put.
    inbox: deque[TokenOutputMsg | _WorkerLost] = field(default_factory=deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    worker_id: str | None = None  # the decode (or colocated) worker streaming its tokens
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set with a _WorkerLost in the inbox
    touched: list[WorkerClient] = field(default_factory=list)  # the workers that may hold some of it
    is_finished: bool = False  # nothing is left on any worker: no abort needed
    waiting_since: float | None = None  # loop time _next began waiting for its worker (None: not waiting)
    # The prefill worker whose push its decode worker waits for; None once that worker has sent anything
    # (the KV came) or where no push was made.
    kv_from: str | None = None

    def put(self, item: TokenOutputMsg | _WorkerLost) -> None:
        self.inbox.append(item)
        self.arrived.set()


@dataclass
class _Progress:
    """What the client has been given so far, across attempts."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    router_id: str
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_attempts: int = 0
    failed_workers: set[str] = field(default_factory=set)  # not tried again for this request if avoidable
    prefill_id: str | None = None  # the prefill worker whose prefix cache holds the prompt

    def next_request(self) -> GenerateRequestMsg:
        n = len(self.token_ids)
        attempt_id = self.request_id if self.num_attempts == 0 else f"{self.request_id}#{self.num_attempts}"
        params = self.params
        if n:
            params = params.model_copy(
                update={"max_tokens": params.max_tokens - n, "min_tokens": max(0, params.min_tokens - n)}
            )
        return GenerateRequestMsg(
            request_id=attempt_id, prompt_token_ids=self.prompt + self.token_ids, params=params,
            router_id=self.router_id, num_prior_output_tokens=n,
        )

    def take(self, out: TokenOutputMsg) -> TokenOutputMsg:
        """Records an output of the current attempt and returns it as the client sees it."""
        if self.num_attempts == 0:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.token_ids += out.new_token_ids
        return out._replace(
            request_id=self.request_id, num_prompt_tokens=len(self.prompt), num_cached_tokens=self.num_cached_tokens
        )


class Dispatcher:
    def __init__(
        self,
        router_id: str,
        workers: Workers,
        poll_timeout_s: float = 1.0,
        on_prefill_result: Callable[[PrefillResultMsg], None] | None = None,
        config: DispatcherConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: DispatchPolicy | None = None,
        prefill_rule: PrefillRule | None = None,
        block_size: int = 16,
    ) -> None:
        """block_size: the workers' KV block size, which the prefix index hashes prompts in (it adopts the
        workers' own once it reads their caches; prompts sent before that are remembered in this one)."""
        self.router_id = router_id
        self.on_prefill_result = on_prefill_result  # metrics: prefill and KV-push timings
        self.workers = workers
        self.poll_timeout_s = poll_timeout_s  # how long a poll waits on the worker for news
        self.config = config or DispatcherConfig()
        self.clock = clock
        self.num_migrations = 0  # attempts started after a failed one, since start
        self.num_local_prefills = 0  # disaggregated attempts prefilled on their decode worker, since start
        self._attempts: dict[str, _Attempt] = {}  # attempt id -> the attempt, while it runs
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._stall_watch: asyncio.Task[None] | None = None  # fails attempts whose worker went quiet
        self._failed_until: dict[str, float] = {}  # worker id -> clock() until which it gets no new attempt
        # Which worker first: by default cache-aware (prefix, then load), fed by a load tracker and by a
        # mirror of the workers' prefix caches, which the default policy and prefill rule share.
        self.loads = LoadTracker(self._fetch_stats, self.config.load_refresh_s)
        self.prefix = PrefixIndex(block_size)
        self.cache = CacheMirror(self.prefix, self._fetch_cache_delta, self.config.load_refresh_s)
        self.policy = policy or CacheAwarePolicy(loads=self.loads.loads, clock=self.loads.clock, prefix=self.prefix)
        local = self.config.local_prefill
        step_ms = self.config.slo.step_budget_ms
        self.prefill_rule = prefill_rule or create_prefill_rule(
            local.rule, max_short_prompt_tokens=local.max_short_prompt_tokens,
            min_cached_fraction=local.min_cached_fraction, loads=self.loads.loads,
            step_s=step_ms / 1e3 if step_ms is not None else None, clock=self.loads.clock, prefix=self.prefix,
        )

    def num_streaming(self) -> dict[str, int]:
        """Per worker, the attempts whose tokens it streams now (this router's requests)."""
        counts: dict[str, int] = {}
        for attempt in self._attempts.values():
            if attempt.worker_id is not None and not attempt.is_finished:
                counts[attempt.worker_id] = counts.get(attempt.worker_id, 0) + 1
        return counts

    def _client(self, worker_id: str) -> WorkerClient:
        client = self.workers.decode.get(worker_id) or self.workers.prefill.get(worker_id)
        if client is None:
            raise KeyError(worker_id)
        return client

    async def _fetch_stats(self, worker_id: str) -> WorkerStatsMsg:
        return await self._client(worker_id).stats()

    async def _fetch_cache_delta(self, worker_id: str, epoch: str, cursor: int) -> CacheDeltaMsg:
        return await self._client(worker_id).cache_delta(epoch, cursor)

    # ---- the worker set
    def set_workers(self, workers: Workers) -> None:
        """Takes a new worker set (a worker was replaced, added or retired); requests on decode
        workers that left move to others."""
        for worker_id in set(self.workers.decode) - set(workers.decode):
            task = self._pollers.pop(worker_id, None)
            if task is not None:
                task.cancel()
            self._lose_requests_of(worker_id, f"decode worker {worker_id} left the cluster")
            self.prefill_rule.forget(worker_id)
        self.workers = workers
        for worker_id in list(self._failed_until):
            if worker_id not in workers.decode and worker_id not in workers.prefill:
                del self._failed_until[worker_id]
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the next request starts the pollers
        self._ensure_pollers()

    def _usable(
        self, kind: str, handles: Mapping[str, C], avoid: set[str], prompt: Sequence[int] = ()
    ) -> list[tuple[str, C]]:
        """Workers that may take a new attempt, in the policy's order; those in `avoid` (failed for
        this request) last, and workers whose calls failed recently not at all."""
        now = self.clock()
        ids = [i for i in handles if self._failed_until.get(i, 0.0) <= now]
        if kind == "prefill":
            ids = self.policy.prefill_order(prompt, ids)
        elif kind == "colocated":
            ids = self.policy.colocated_order(prompt, ids)
        else:
            ids = self.policy.decode_order(len(prompt), ids)
        ids.sort(key=lambda i: i in avoid)  # stable: keeps the policy's order within each group
        return [(i, handles[i]) for i in ids]

    def _mark_failed(self, worker_id: str, err: object) -> None:
        log.warning("worker %s failed a call: %s", worker_id, err)
        self._failed_until[worker_id] = self.clock() + self.config.failed_worker_cooldown_s

    # ---- the token stream
    def _ensure_pollers(self) -> None:
        """The token pollers of the decode workers, and the stall watchdog (every attempt starts here)."""
        if self._stall_watch is None or self._stall_watch.done():
            self._stall_watch = asyncio.get_running_loop().create_task(self._watch_stalls())
        worker_ids = [*self.workers.prefill, *self.workers.decode]
        self.loads.track(worker_ids)
        self.cache.track(worker_ids)
        now = self.clock()
        for worker_id, handle in self.workers.decode.items():
            task = self._pollers.get(worker_id)
            if (task is None or task.done()) and self._failed_until.get(worker_id, 0.0) <= now:
                self._pollers[worker_id] = asyncio.get_running_loop().create_task(self._poll(worker_id, handle))

    async def _poll(self, worker_id: str, client: DecodeClient) -> None:
        deadline_s = self.poll_timeout_s + self.config.call_timeout_s
        while True:
            try:
                batch = await asyncio.wait_for(client.next_batch(self.router_id, self.poll_timeout_s), deadline_s)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the worker is gone or hangs: move its requests
                self._mark_failed(worker_id, f"poll: {type(err).__name__}: {err}")
                self._lose_requests_of(worker_id, f"decode worker {worker_id} failed: {type(err).__name__}: {err}")
                return
            for out in batch.outputs:
                attempt = self._attempts.get(out.request_id)
                if attempt is not None and attempt.worker_id == worker_id:
                    attempt.put(out)

    def _lose_requests_of(self, worker_id: str, reason: str) -> None:
        for attempt in self._attempts.values():
            if attempt.worker_id == worker_id:
                attempt.put(_WorkerLost(reason))
                attempt.lost.set()

    async def close(self) -> None:
        self.loads.close()
        self.cache.close()
        tasks = [*self._pollers.values(), *([self._stall_watch] if self._stall_watch is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._stall_watch = None
        self._pollers.clear()

    # ---- one request
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenOutputMsg]:
        """Yields the request's token outputs; the last has a finish_reason. Leaving early
        (client gone) aborts it on every worker that holds something of it. Raises
        NoCapacityError, RequestFailedError, or InvalidRequestError (bad input a worker refused)."""
        progress = _Progress(request_id, list(prompt_token_ids), params, self.router_id)
        while True:
            if len(progress.token_ids) >= params.max_tokens:  # cannot happen: the last token had a finish_reason
                yield TokenOutputMsg(request_id=request_id, new_token_ids=[], finish_reason="length")
                return
            attempt = _Attempt(progress.next_request())
            self._attempts[attempt.request.request_id] = attempt
            try:
                out = await self._start(attempt, progress)
                while True:
                    if out is not None:
                        yield progress.take(out)
                        if out.finish_reason is not None:
                            attempt.is_finished = True
                            self._on_finished(attempt, progress)
                            return
                    out = await self._next(attempt)
                    attempt.kv_from = None
            except _AttemptFailed as failure:
                progress.num_attempts += 1
                if attempt.worker_id is not None:
                    progress.failed_workers.add(attempt.worker_id)
                # NOTE: the KV never came: the prefill worker's way out may be what fails, and its prefix
                # cache would bring the next attempt back to it (_prefill): another goes first if there is one
                if attempt.kv_from is not None:
                    progress.failed_workers.add(attempt.kv_from)
                log.warning("request %s: attempt %d failed: %s", request_id, progress.num_attempts, failure)
                if progress.num_attempts >= self.config.max_attempts:
                    raise RequestFailedError(
                        f"request {request_id} failed {progress.num_attempts} times (max_attempts); last: {failure}"
                    ) from None
                self.num_migrations += 1
            finally:
                del self._attempts[attempt.request.request_id]
                if attempt.worker_id is not None:
                    self.policy.on_finished(attempt.worker_id)
                if not attempt.is_finished:
                    await asyncio.shield(self._abort(attempt))

    async def _start(self, attempt: _Attempt, progress: _Progress) -> TokenOutputMsg | None:
        """Places the attempt; through a prefill worker, returns its first token."""
        self._ensure_pollers()
        if self.workers.is_colocated:
            await self._submit_colocated(attempt, progress)
            return None
        if await self._prefill_locally(attempt, progress):
            return None
        try:
            return await self._prefill(attempt, progress)
        except _NoPrefillWorker as err:
            # NOTE: a decode worker that takes it computes the prompt itself rather than the request failing (the
            # last prefill worker died or fails its calls until a replacement serves); nothing was placed yet
            log.info("request %s: %s; prefilling it on a decode worker", attempt.request.request_id, err)
            if await self._prefill_locally(attempt, progress, anywhere=True):
                return None
            raise NoCapacityError(f"{err}, and no decode worker took the prompt itself") from None

    def _on_finished(self, attempt: _Attempt, progress: _Progress) -> None:
        """The request ended well: its decode worker's prefix cache now holds its prompt and all
        but its last token (whose KV was never computed)."""
        if not self.workers.is_colocated and attempt.worker_id is not None:
            self.prefill_rule.on_cached(attempt.worker_id, (progress.prompt + progress.token_ids)[:-1])

    async def _next(self, attempt: _Attempt) -> TokenOutputMsg:
        """The attempt's next output. Outputs of several steps waiting in its inbox (the router
        was busy) leave as one: fewer deltas, SSE chunks and messages downstream, under load."""
        inbox = attempt.inbox
        if not inbox:
            attempt.arrived.clear()
            # NOTE: no timeout context a wait (~15 us of a streamed token's ~65 us of router CPU):
            # _watch_stalls fails an attempt whose wait outlasts stall_timeout_s.
            attempt.waiting_since = asyncio.get_running_loop().time()
            try:
                await attempt.arrived.wait()
            finally:
                attempt.waiting_since = None
        item = self._checked(attempt, inbox.popleft())
        while item.finish_reason is None and inbox and _is_tokens(inbox[0]):
            item = _merge(item, inbox.popleft())  # type: ignore[arg-type]
        return item

    async def _watch_stalls(self) -> None:
        """Every stall_timeout_s / 4 (at most 1 s): an attempt waiting for its worker longer than
        stall_timeout_s gets a failure in its inbox (the request then moves to another worker)."""
        stall_s = self.config.stall_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, stall_s / 4))
            now = loop.time()
            for attempt in list(self._attempts.values()):
                since = attempt.waiting_since
                if since is not None and now - since >= stall_s:
                    attempt.waiting_since = None
                    reason = f"worker {attempt.worker_id} sent nothing for {stall_s} s (stall_timeout_s)"
                    attempt.put(_WorkerLost(reason))

    @staticmethod
    def _checked(attempt: _Attempt, item: TokenOutputMsg | _WorkerLost) -> TokenOutputMsg:
        if isinstance(item, _WorkerLost):
            raise _AttemptFailed(item.reason)
        if item.error is not None:
            attempt.is_finished = True  # the worker has freed what it held
            raise _AttemptFailed(f"worker {attempt.worker_id}: {item.error}")
        return item

    async def _wait_for_workers(self, kind: str, handles: Callable[[], Mapping[str, C]], avoid: set[str],
                                prompt: Sequence[int] = ()) -> list[tuple[str, C]]:
        """Usable workers of a kind, waiting up to max_capacity_wait_s for one (a replacement starting)."""
        deadline = self.clock() + self.config.max_capacity_wait_s
        delay_s = 0.05
        while not (usable := self._usable(kind, handles(), avoid, prompt)):
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise NoCapacityError(f"no {kind} worker is serving")
            await asyncio.sleep(min(delay_s, remaining))
            delay_s = min(2 * delay_s, 0.5)
        return usable

    async def _submit_colocated(self, attempt: _Attempt, progress: _Progress) -> None:
        prompt = attempt.request.prompt_token_ids
        usable = await self._wait_for_workers("colocated", lambda: self.workers.decode, progress.failed_workers, prompt)
        worker_id, client = usable[0]
        self._place(attempt, client)
        self.policy.on_sent(worker_id, prompt)
        if len(usable) > 1:  # NOTE: hashed by colocated_order just now; with one worker it goes unhashed
            self.policy.on_prompt(worker_id, prompt)
        await self._call_placed(worker_id, client.submit(attempt.request), "colocated worker")

    def _place(self, attempt: _Attempt, client: DecodeClient) -> None:
        """The attempt now runs on the worker. NOTE: before the call: its first tokens may be polled
        before the call returns."""
        attempt.worker_id = client.worker_id
        attempt.touched.append(client)
        self.policy.on_assigned(client.worker_id, None)

    async def _call_placed(self, worker_id: str, call: Awaitable[T], what: str) -> T:
        """The placing call, under call_timeout_s: bad input is the client's error; any other failure
        marks the worker failed and fails the attempt."""
        try:
            return await asyncio.wait_for(call, self.config.call_timeout_s)
        except Exception as err:  # noqa: BLE001 - bad input is the client's; anything else, the worker's
            _raise_if_invalid(err)
            self._mark_failed(worker_id, err)
            raise _AttemptFailed(f"{what} {worker_id} failed: {type(err).__name__}: {err}") from None

    async def _prefill_locally(self, attempt: _Attempt, progress: _Progress, anywhere: bool = False) -> bool:
        """Places the attempt on a decode worker that computes the prompt itself, when the prefill
        rule picks some (anywhere: any, no prefix asked) and one of them takes it; False: nothing was placed."""
        prompt = attempt.request.prompt_token_ids
        candidates = {i: h for i, h in self.workers.decode.items() if i not in progress.failed_workers}
        if anywhere:
            picked, min_cached_tokens = list(candidates), 0
        else:
            picked, min_cached_tokens = self.prefill_rule.local_workers(prompt, list(candidates))
        if not picked:
            return False
        local = LocalPrefillMsg(request=attempt.request, min_cached_tokens=min_cached_tokens)
        for worker_id, client in self._usable("decode", {i: candidates[i] for i in picked}, set(), prompt):
            self._place(attempt, client)
            reply = await self._call_placed(worker_id, client.prefill_locally(local), "decode worker")
            if reply.accepted:
                self.prefill_rule.on_cached(worker_id, prompt)
                self.num_local_prefills += 1
                return True
            log.debug("decode worker %s declined to prefill %s: %s", worker_id, attempt.request.request_id,
                      reply.reason)
            self.policy.on_finished(worker_id)
            attempt.worker_id = None
            attempt.touched.pop()
        return False

    async def _reserve(self, attempt: _Attempt, progress: _Progress) -> tuple[DecodeClient, LeaseMsg]:
        """A lease on the first decode worker with room; waits up to max_capacity_wait_s for one."""
        request = attempt.request
        reserve = ReserveMsg(
            request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids), router_id=self.router_id
        )
        deadline = self.clock() + self.config.max_capacity_wait_s
        delay_s = 0.02
        while True:
            usable = await self._wait_for_workers(
                "decode", lambda: self.workers.decode, progress.failed_workers, request.prompt_token_ids
            )
            for worker_id, client in usable:
                try:
                    lease = await asyncio.wait_for(client.reserve(reserve), self.config.call_timeout_s)
                except Exception as err:  # noqa: BLE001 - a dead or hung worker: try the next
                    self._mark_failed(worker_id, err)
                    continue
                if lease is not None:
                    self.policy.on_assigned(worker_id, None)
                    return client, lease
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise NoCapacityError(
                    f"no decode worker has KV blocks for {len(request.prompt_token_ids)} prompt tokens"
                )
            await asyncio.sleep(min(delay_s, remaining))
            delay_s = min(2 * delay_s, 0.5)

    async def _prefill(self, attempt: _Attempt, progress: _Progress) -> TokenOutputMsg:
        """A lease on a decode worker, then one call to a prefill worker with the request and the
        lease: its answer is the first token (the KV push goes on after it; a push that fails reaches
        this attempt from the decode worker's stream)."""
        request = attempt.request
        # NOTE: the prefill worker first, so that a request finding none holds no lease meanwhile.
        try:
            usable = await self._wait_for_workers(
                "prefill", lambda: self.workers.prefill, progress.failed_workers, request.prompt_token_ids
            )
        except NoCapacityError as err:
            raise _NoPrefillWorker(str(err)) from None
        # A continuation goes back to the prefill worker that computed the prompt: its prefix cache holds it.
        preferred = [w for w in usable if w[0] == progress.prefill_id and w[0] not in progress.failed_workers]
        prefill_id, prefill = (preferred or usable)[0]
        decode, lease = await self._reserve(attempt, progress)
        decode_id = decode.worker_id
        # NOTE: placed before the call: the decode worker may report the push's failure before the answer comes.
        attempt.worker_id = decode_id
        attempt.touched += [decode, prefill]
        progress.prefill_id = prefill_id
        self.policy.on_assigned(prefill_id, None)
        call = asyncio.ensure_future(prefill.prefill(PrefillTaskMsg(request=request, lease=lease), decode))
        # NOTE: after the call has gone: hashing a long prompt takes a fraction of a ms.
        loop = asyncio.get_running_loop()
        loop.call_soon(self.policy.on_prompt, prefill_id, request.prompt_token_ids)
        lost = asyncio.ensure_future(attempt.lost.wait())  # the decode worker may die meanwhile
        try:
            done, _ = await asyncio.wait({call, lost}, timeout=self.config.prefill_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.policy.on_finished(prefill_id)
            for future in (call, lost):
                if not future.done():
                    future.cancel()
        if lost in done:
            raise _AttemptFailed(f"decode worker {decode_id} was lost during the prefill")
        if call not in done:
            progress.failed_workers.add(prefill_id)
            raise _AttemptFailed(f"prefill worker {prefill_id} did not answer within {self.config.prefill_timeout_s} s")
        try:
            result = call.result()
        except Exception as err:  # noqa: BLE001 - bad input is the client's; anything else, the worker's
            _raise_if_invalid(err)
            self._mark_failed(prefill_id, err)
            progress.failed_workers.add(prefill_id)
            raise _AttemptFailed(f"prefill worker {prefill_id} failed: {type(err).__name__}: {err}") from None
        if self.on_prefill_result is not None:
            self.on_prefill_result(result)
        if result.error is not None:
            raise _AttemptFailed(f"prefill on {prefill_id} for decode worker {decode_id}: {result.error}")
        if result.finish_reason is not None:
            await self._abort(attempt, [decode])  # the lease is not needed: free it now
            attempt.is_finished = True
        else:  # the KV lands there; NOTE: noted once the first token has gone on (it hashes the prompt)
            attempt.kv_from = prefill_id
            loop.call_soon(self.prefill_rule.on_cached, decode_id, request.prompt_token_ids)
        return TokenOutputMsg(
            request_id=request.request_id,
            new_token_ids=[result.first_token] if result.first_token is not None else [],
            logprobs=[result.logprob] if result.logprob is not None else None,
            top_logprobs=[result.top_logprobs] if result.top_logprobs is not None else None,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
        )

    async def _abort(self, attempt: _Attempt, touched: list[WorkerClient] | None = None) -> None:
        """Frees what the attempt holds on every worker it touched (or those given); a dead worker
        holds nothing."""

        async def one(client: WorkerClient) -> None:
            try:
                await asyncio.wait_for(client.abort(attempt.request.request_id), self.config.call_timeout_s)
            except Exception as err:  # noqa: BLE001 - a dead worker holds nothing any more
                log.info("abort of %s on %s failed: %s", attempt.request.request_id, client.worker_id, err)

        await asyncio.gather(*(one(c) for c in (attempt.touched if touched is None else touched)))


def _is_tokens(item: TokenOutputMsg | _WorkerLost) -> bool:
    return not isinstance(item, _WorkerLost) and item.error is None


def _merge(first: TokenOutputMsg, then: TokenOutputMsg) -> TokenOutputMsg:
    """Two consecutive outputs of one request as one (the later one's finish and counts)."""
    logprobs = first.logprobs if then.logprobs is None else (first.logprobs or []) + then.logprobs
    top = first.top_logprobs if then.top_logprobs is None else (first.top_logprobs or []) + then.top_logprobs
    return then._replace(new_token_ids=first.new_token_ids + then.new_token_ids, logprobs=logprobs, top_logprobs=top)


def _raise_if_invalid(err: BaseException) -> None:
    """Re-raises a worker's InvalidRequestError (bare, even when Ray wrapped it): the client's mistake."""
    cause = getattr(err, "cause", err)
    if isinstance(cause, InvalidRequestError):
        raise cause from None
