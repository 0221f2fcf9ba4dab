"""Iteration-level (continuous) batching over a BlockPool.

Each step: running requests first, oldest first (decodes and unfinished prompt chunks), then
waiting requests in arrival order, all under one token budget. When blocks run out for a running
request, the newest running request is preempted by recompute: its blocks are freed (full ones
stay in the prefix cache) and it waits at the head of the queue to be computed again.

A request whose prompt KV was computed elsewhere (a prefill worker's push) arrives with its blocks
and is ready: it joins the running batch, ahead of the waiting requests, once the batch has room
(max_num_seqs holds for every request a worker runs, wherever its prompt was computed).

Speculation: a decoding request with a `draft` also computes its drafted positions, budget and
blocks permitting; drafts are dropped before any request is preempted for blocks. After the step
the engine keeps the KV of the accepted tokens only (`accept_verified`): the rejected positions
roll back and the blocks past the last computed token are freed.
Knows nothing of tensors: the runner turns a `SchedulerOutput` into a forward pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.config import SchedulerConfig
from engine.kv_cache import BlockPool
from engine.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):  # NOTE: a NamedTuple, not a frozen dataclass: one is built per request a step
    request: Request
    num_new_tokens: int  # computes positions [num_computed_tokens, num_computed_tokens + num_new_tokens)
    will_sample: bool  # this step computes the request's last token, so its logits are sampled
    # The last num_spec_tokens of the new positions take the draft's first tokens as input; their
    # logits are sampled too (verification). 0: no speculation for this request this step.
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prompt_tokens: int = 0  # of the scheduled tokens, prompt ones (prefills and chunks)
    num_prompt_rows: int = 0  # scheduled requests computing prompt tokens

    @property
    def num_decode_rows(self) -> int:
        return len(self.scheduled) - self.num_prompt_rows

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampling(self) -> list[Request]:
        return [s.request for s in self.scheduled if s.will_sample]


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # prefilled elsewhere, holding their blocks; join before `waiting`
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start
        self.num_prompts_started = 0  # since start: prompts admitted to compute here the first time

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Ends a request wherever it is and frees its blocks. Unknown or finished ids: None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._queue_of(request).remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    # ---- schedule
    def schedule(self, skip: frozenset[str] | set[str] = frozenset(),
                 prompt_budget: int | None = None) -> SchedulerOutput:
        """The step's batch. `skip`: ids of running requests left out of this step (asynchronous
        scheduling: those whose in-flight token ends them by length). `prompt_budget`: the most
        prompt tokens (prefill chunks, new prompts) the step may compute while some running request
        decodes (the inter-token latency budget); None: the token budget alone."""
        out = SchedulerOutput()
        while self.ready and len(self.running) < self.config.max_num_seqs:
            request = self.ready.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        budget = self.config.max_num_batched_tokens
        prompt_left = None
        if prompt_budget is not None and any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            prompt_left = max(1, prompt_budget)
        budget, prompt_left = self._schedule_running(out, budget, skip, prompt_left)
        if not out.preempted:
            self._schedule_waiting(out, budget if prompt_left is None else min(budget, prompt_left))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, skip: frozenset[str] | set[str],
                          prompt_left: int | None) -> tuple[int, int | None]:
        """Returns what is left of the token budget and of the prompt budget (None: no separate cap)."""
        index = 0
        running, scheduled, block_size = self.running, out.scheduled, self.block_size
        while index < len(running) and budget > 0:
            request = running[index]
            if skip and request.request_id in skip:
                index += 1
                continue
            num_tokens, num_computed = len(request.token_ids), request.num_computed_tokens
            num_new = min(num_tokens - num_computed, budget)
            is_prompt = num_computed < len(request.prompt_token_ids)
            if is_prompt:
                if prompt_left is not None:
                    num_new = min(num_new, prompt_left)
                    if num_new == 0:
                        index += 1  # NOTE: no prompt room left this step; it continues in the next
                        continue
                    prompt_left -= num_new
                out.num_prompt_tokens += num_new
                out.num_prompt_rows += 1
            if request.draft is None and num_computed + num_new <= len(request.block_ids) * block_size:
                # NOTE: the common decode step: no draft, and its blocks hold the new positions
                will_sample = num_computed + num_new == num_tokens
                scheduled.append(ScheduledRequest(request, num_new, will_sample))
                budget -= num_new
                index += 1
                continue
            num_spec = self._num_spec_tokens(request, budget - num_new)
            if num_spec and not self.pool.can_allocate(self._blocks_needed(request, num_new + num_spec)):
                num_spec = 0  # NOTE: drafts go before any request is preempted for their blocks
            while not self.pool.can_allocate(self._blocks_needed(request, num_new)):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self._grow(request, num_new + num_spec)
                out.scheduled.append(self._scheduled(request, num_new, num_spec))
                budget -= num_new + num_spec
                index += 1
                continue
            if is_prompt:  # NOTE: preempted, not scheduled
                out.num_prompt_tokens -= num_new
                out.num_prompt_rows -= 1
            break  # the request itself was preempted: nothing after it can run either
        return budget, prompt_left

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self._prefix_hits(request)
            num_cached = len(hits) * self.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            new_blocks = -(-(num_cached + num_new) // self.block_size) - len(hits)
            # NOTE: cached hits no one holds leave the free count when acquired: ask for both.
            idle_hits = sum(self.pool.ref_count(b) == 0 for b in hits)
            if not self.pool.can_allocate(new_blocks + idle_hits):
                break
            self.waiting.popleft()
            self.pool.acquire(hits)
            request.block_ids = hits + self.pool.allocate(new_blocks)
            request.num_committed_blocks = len(hits)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                self.num_prompts_started += 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            out.num_prompt_tokens += num_new
            out.num_prompt_rows += 1
            budget -= num_new

    def _prefix_hits(self, request: Request) -> list[int]:
        hashes = request.update_block_hashes(self.block_size)
        # At least one token must be computed, so the step yields logits to sample from.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return self.pool.find_cached_prefix(hashes[:max_hit_blocks])

    @staticmethod
    def _num_spec_tokens(request: Request, budget: int) -> int:
        """How many of the request's drafted tokens this step verifies: only in decode, within budget."""
        if request.draft is None or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        return min(len(request.draft), budget)

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        return max(0, -(-(request.num_computed_tokens + num_new) // self.block_size) - len(request.block_ids))

    def _grow(self, request: Request, num_new: int) -> None:
        request.block_ids.extend(self.pool.allocate(self._blocks_needed(request, num_new)))

    @staticmethod
    def _scheduled(request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        will_sample = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new + num_spec, will_sample, num_spec)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        request.draft = None
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0

    # ---- post-process
    def advance(self, out: SchedulerOutput) -> None:
        """Records that the step's tokens now have KV; registers newly full blocks for reuse.
        Speculating requests are left to `accept_verified`, once their accepted tokens are known;
        requests finished since the step was scheduled (asynchronous scheduling) are skipped."""
        block_size = self.block_size
        for s in out.scheduled:
            if s.num_spec_tokens:
                continue
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += s.num_new_tokens
            if request.num_computed_tokens // block_size > request.num_committed_blocks:
                self.commit_computed_blocks(request)  # NOTE: a block filled up; otherwise nothing to commit

    def accept_verified(self, request: Request, num_computed: int) -> None:
        """After a verification step: the first `num_computed` positions the step computed keep their
        KV (the last accepted token's input and the accepted drafts, already appended to
        token_ids); the rejected positions roll back and the blocks past them are freed. Only
        blocks full of accepted tokens reach the prefix cache."""
        request.num_computed_tokens += num_computed
        assert request.num_computed_tokens <= request.num_tokens, "more KV than tokens"
        self.commit_computed_blocks(request)
        num_kept = -(-request.num_computed_tokens // self.block_size)
        self.pool.free(request.block_ids[num_kept:])
        del request.block_ids[num_kept:]

    def finish(self, request: Request, status: RequestStatus) -> list[int]:
        """Retires a running request (or one preempted since its last token was scheduled:
        asynchronous scheduling). Its blocks are freed, or, with `hold_kv`, handed to the
        caller still held (the caller frees them)."""
        self._queue_of(request).remove(request)
        del self.requests[request.request_id]
        kept = request.block_ids if request.hold_kv else []
        if request.hold_kv:
            request.block_ids = []
        self._release(request)
        request.status = status
        return kept

    def add_ready(self, request: Request) -> None:
        """Queues a request whose prompt KV is already in its blocks (it arrived from a prefill worker):
        it joins the running batch at the next step with room for it."""
        request.status = RequestStatus.READY
        self.requests[request.request_id] = request
        self.ready.append(request)

    def _queue_of(self, request: Request) -> deque[Request] | list[Request]:
        if request.status is RequestStatus.WAITING:
            return self.waiting
        return self.ready if request.status is RequestStatus.READY else self.running

    def commit_computed_blocks(self, request: Request) -> None:
        hashes = request.update_block_hashes(self.block_size)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for i in range(request.num_committed_blocks, num_full):
            self.pool.commit(request.block_ids[i], hashes[i])
        request.num_committed_blocks = max(request.num_committed_blocks, num_full)

    def num_held_blocks_by_requests(self) -> int:
        """Holder count the requests claim; equals the pool's total ref count when nothing leaks."""
        return sum(len(r.block_ids) for r in (*self.running, *self.ready))
