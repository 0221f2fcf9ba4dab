"""EngineCore: one model on one device, stepping a continuous batch of token-id requests.

`step()` is draft -> schedule -> execute -> post-process. Token ids in, token ids out: text, chat
templates and stop strings are the caller's (see `engine.llm` and the router).

Speculative decoding (EngineConfig.speculative, engine/spec/): before scheduling, the proposer
drafts up to K tokens for each decoding request without a draft. The scheduler gives a drafted
request K more positions; the runner returns logits for its K+1 positions; `Sampler.verify`
accepts a prefix of the draft and adds one token of the target's; post-processing appends those
tokens one by one, checking the stop conditions after each (a stop truncates the run), and rolls
the rejected positions' KV back (`Scheduler.accept_verified`). Requests without drafts decode or
prefill in the same step as before. A StepOutput may then carry several new tokens.

Asynchronous scheduling (SchedulerConfig.async_scheduling; on by default on CUDA): `step()` queues
step N+1 on the device before it reads step N's sampled tokens, so the host's work (scheduling,
staging, post-processing) overlaps the device's instead of leaving it idle. One call:

1. schedule N+1 from counts alone: each request sampled at N already carries a PLACEHOLDER token
   and its KV counts as computed; requests that N's token ends by length are left out;
2. launch N+1: the forward reads each placeholder input from N's sampled-token tensor on the
   device (runner.TokenPatch), then the sampler's kernels; nothing waits for the device;
3. resolve N: read its tokens (the host waits for N only; N+1 is queued behind it), put them in
   place of the placeholders, check stop conditions, finish requests, build N's StepOutputs;
   when N+1 draws for a request with a grammar, its mask needs N's token: the grammar process fills
   it (engine/grammar_book.py) while the device runs N+1's forward, and N+1's draw is queued after this
   stage, behind a gate on the device that the fill opens (engine/host_gate.py);
4. book N+1: its KV counts and block commits (every token in them is real by now), and its own
   placeholders. step() returns N's outputs: each token reaches the caller one call later.

A request that N's token stops (EOS, a stop token) was already queued in N+1: that step computes
one position it did not need (the KV of its real last token) and its draw is dropped. Freed blocks
are safe to hand out at once: any later write to them is queued after N+1's. A step reads N's
tokens first (the synchronous order) when a request sampled at N applies penalties (they read the
output's token values) or holds its KV for a push (the prefill role). With a proposer, a step that
drafts (a batch of at most disable_above_batch_size requests, where the draft gate measured drafting
faster: engine/spec/gate.py) runs synchronously: the call that meets one after asynchronous steps
only reads the step in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import EngineConfig, SamplingParams
from engine.cuda_graphs import graph_max_rows
from engine.grammar import GrammarError, TokenMask
from engine.grammar_book import GrammarBook
from engine.kv_cache import BlockPool, IntegrityError
from engine.models import ArchConfig, check_quantized_parallel
from engine.parallel import RankSet, RankStarter, TensorParallel, check_tensor_parallel
from engine.parallel.rank_stats import RankReport, RankStats, allocator_counts
from engine.parallel.follower import Stop
from engine.parallel.local import LocalRanks
from engine.pinned import upload
from engine.rank import (build_cache, build_parts, build_runner, checkpoint_arch, max_model_len, resolve_device,
                         resolve_dtype, resolve_model_dir)
from engine.request import Request, RequestStatus
from engine.runner import TokenPatch
from engine.sampler import PendingSample, PendingVerify, Sampler, SamplingRow, VerifyRow, has_penalty
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec import DraftModelProposer, DraftRequest, ProposerContext, SpecCounters, adaptive, build_proposer
from engine.spec.gate import DraftGate
from engine.stats import EngineStats
from engine.step_rates import StepRates
from engine.step_timer import step_timer_for
from engine.warmup import warm_up_gate, warm_up_sampler, warm_up_verifier
from engine.validation import InvalidRequestError, validate_prompt

log = logging.getLogger(__name__)


class _Sampled(NamedTuple):  # NOTE: NamedTuples, not frozen dataclasses, for what is built per request a step
    """One sampling request's tokens from one step, before stop conditions."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    num_accepted: int = 0  # drafted tokens accepted (verifying requests)


class StepOutput(NamedTuple):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[float] | None  # per new token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_block_ids: list[int] | None = None  # finished with hold_kv: the blocks now held for the caller


PLACEHOLDER = -1  # an in-flight step's sampled token, in token_ids until the host reads it


@dataclass(frozen=True)
class _Inflight:
    """A step queued on the device whose sampled tokens the host has not read."""

    sampling: list[ScheduledRequest]  # the requests it samples, in the draw's row order
    pending: PendingSample | None
    ending: frozenset[str]  # ids of requests whose token from this step ends them by length
    # A request sampled here applies penalties (they read its tokens' values) or holds its KV for
    # a push: the next step reads these tokens before it is scheduled (the synchronous order).
    needs_tokens_first: bool


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 start_ranks: RankStarter = LocalRanks) -> None:
        """With config.parallel.tensor_parallel_size N > 1 this is rank 0 of N: `start_ranks` starts
        the others (engine/parallel/follower.py), on this machine by default; close() stops them."""
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model.model)
        self.ranks: RankSet | None = None
        self.tp: TensorParallel | None = None
        if config.parallel.tensor_parallel_size > 1:
            # NOTE: before any rank starts: a size that does not divide the model is named at once
            check_tensor_parallel(checkpoint_arch(self.model_dir), config.parallel.tensor_parallel_size)
            check_quantized_parallel(self.model_dir, config.parallel.tensor_parallel_size)
            self.ranks = start_ranks(config, self.device)
            self.tp = TensorParallel.of(self.ranks.group)
        parts = build_parts(config, self.model_dir, self.device, self.dtype, self.tp)
        arch = parts.arch
        self.arch: ArchConfig = arch
        model, self.kv_dtype, self.kv_scales = parts.model, parts.kv_dtype, parts.kv_scales
        self.weights = (f"fp8 projections on the {model.fp8_path} path" if model.fp8_path is not None
                        else f"4-bit projections on the {model.int4_path} path" if model.int4_path is not None
                        else str(self.dtype).removeprefix("torch."))
        self.parallel = "" if self.tp is None else (
            f"TP={self.tp.group.size}, small all-reduces on "
            + ("symmetric memory" if self.tp.group.reduces_symmetrically
               else "NCCL" if self.device.type == "cuda" else "gloo"))
        log.info("pdserve engine: %s on %s, weights %s, KV cache %s%s%s", config.model.model, self.device, self.weights,
                 str(self.kv_dtype).removeprefix("torch."), self.kv_scales_kind and f" ({self.kv_scales_kind} scales)",
                 self.parallel and f", {self.parallel}")
        self.eos_token_ids = frozenset(arch.eos_token_ids)
        self.max_model_len = max_model_len(arch, config.model.max_model_len)
        block_size = config.cache.block_size
        self.sampler = Sampler(arch.eos_token_ids, fused=config.model.fused_ops and self.device.type == "cuda")
        # NOTE: the proposer (a draft model's weights, on rank 0 alone) is built before the cache is
        # sized, so the KV budget is what both leave.
        self.proposer = build_proposer(
            ProposerContext(
                config.speculative, config.model, arch, self.device, self.dtype, block_size,
                config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens, self.sampler,
                None if config.model.enforce_eager else graph_max_rows(config),
            )
        )
        extra_bytes = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        kv = build_cache(config, parts, self.device, self.max_model_len, self.tp, extra_bytes)
        num_blocks = kv.shape[2]
        if self.proposer is not None:
            self.proposer.bind(num_blocks, min(self.max_model_len, num_blocks * block_size))
        self.spec_counters = SpecCounters()
        # Whether a step drafts, from the measured rates of steps that did and did not (engine/spec/gate.py)
        self.draft_gate = DraftGate() if self.proposer is not None else None
        self._step_drafted = False  # whether the step being taken asked the proposer for drafts
        self._step_prompted = False  # whether the step being taken computes prompt tokens
        drafts = config.speculative.num_draft_tokens if self.proposer is not None else 0
        self.grammars = GrammarBook(self.model_dir, arch.vocab_size, arch.eos_token_ids,
                                    config.scheduler.max_num_seqs * (1 + drafts), self.device.type == "cuda")
        self.block_bytes = parts.block_bytes  # this rank's heads
        self.pool = BlockPool(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.pool)
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        # Blocks held outside running requests, by key: a prefill's finished request awaiting its
        # push (key = request id) or a decode worker's lease (key = lease id).
        self.held: dict[str, list[int]] = {}
        # A request alone must always fit the cache, so it never waits for blocks that cannot come.
        self.max_seq_tokens = min(self.max_model_len, self.capacity_tokens)
        asked = config.scheduler.async_scheduling
        # NOTE: with a proposer, steps that draft run synchronously (drafting reads the tokens); the
        # others (a batch past disable_above_batch_size) run asynchronously when this is on.
        self.async_scheduling = self.device.type == "cuda" if asked is None else asked
        self._inflight: _Inflight | None = None
        self.rates = StepRates()
        self.step_timer = step_timer_for(self.device, clock)  # each launched step's device time, into `rates`
        # SchedulerConfig.itl_budget_ms, or None while this worker computes every prompt it serves (a decode
        # worker with no prefill pool left: DecodeWorker.computes_every_prompt)
        self.itl_budget_ms: float | None = config.scheduler.itl_budget_ms
        self.runner = build_runner(config, parts, kv, self.device, self.max_seq_tokens, self.tp)
        leader = self.runner.leader
        self._rank_stats = RankStats(leader.group, leader.send) if leader is not None else None
        self.wait_seconds = 0.0  # the host's wait for asynchronous steps' tokens, since start (stats)
        warm_up_sampler(self.sampler, arch.vocab_size, self.device)
        warm_up_gate(self.device)
        if self.proposer is not None:
            warm_up_verifier(self.sampler, arch.vocab_size, self.device, config.speculative.num_draft_tokens)

    def close(self) -> None:
        """Stops the grammar process and the other ranks of a tensor-parallel worker (they leave their
        loops); idempotent."""
        self.grammars.close()
        if self.runner.leader is not None:
            self.runner.leader.send(Stop())
            self.runner.leader = None
            self.runner.release_graphs()  # NOTE: before the group shuts down (CUDA graphs captured its calls)
        if self.ranks is not None:
            self.ranks.join()
            self.ranks = None

    @property
    def ranks_alive(self) -> bool:
        """False once a rank of this tensor-parallel worker has died: the worker cannot step again."""
        return self.ranks is None or self.ranks.is_alive()

    # ---- control
    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
        num_prior_output_tokens: int = 0,
    ) -> None:
        """Queues a request. With `hold_kv` its blocks stay held when it finishes, under its id in
        `held`, until `release_held(request_id)` (the prefill role's KV push).

        `num_prior_output_tokens`: the prompt ends with that many tokens generated for this request
        elsewhere (a moved request's continuation); a seeded request then samples on as if it had
        generated them here, token for token the output it would have given without the move."""
        if request_id in self.scheduler.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        prompt = self._validate(prompt_token_ids, params)
        _check_prior(num_prior_output_tokens, prompt)
        request = Request(
            request_id, prompt, params, arrival_time=self.clock(), hold_kv=hold_kv,
            num_prior_output_tokens=num_prior_output_tokens,
        )
        self._add_grammar(request_id, params, prompt[len(prompt) - num_prior_output_tokens :])
        self.scheduler.add(request)

    def _add_grammar(self, request_id: str, params: SamplingParams, output: Sequence[int]) -> None:
        """A constrained request's matcher, advanced over the output it already has. NOTE: a caller
        compiles the grammar off this thread first (`grammars.compile_within`), so this is a cache hit."""
        if params.grammar is None:
            return
        try:
            self.grammars.add(request_id, params.grammar, output)
        except GrammarError as err:
            raise InvalidRequestError("grammar", str(err)) from None

    def _validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return validate_prompt(
            prompt_token_ids,
            params,
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            max_prompt_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            max_unchunked_tokens=(
                None if self.config.scheduler.enable_chunked_prefill else self.config.scheduler.max_num_batched_tokens
            ),
        )

    def abort_request(self, request_id: str) -> bool:
        """Idempotent: True if the request was live (or its KV held) and now all its blocks are freed."""
        self._drop_request_state(request_id)
        return self.scheduler.abort(request_id) is not None or self.release_held(request_id)

    def _drop_proposer_state(self, request_id: str) -> None:
        if self.proposer is not None:
            self.proposer.drop(request_id)

    def _drop_request_state(self, request_id: str) -> None:
        """What the engine keeps beside a request that leaves: its drafts' state and its matcher."""
        self._drop_proposer_state(request_id)
        self.grammars.drop(request_id)

    # ---- KV held outside running requests (disaggregation)
    def reserve(self, key: str, num_blocks: int) -> list[int] | None:
        """Holds `num_blocks` blocks under `key` (a decode worker's lease); None when they cannot be had."""
        if key in self.held:
            raise ValueError(f"{key!r} already holds blocks")
        if not self.pool.can_allocate(num_blocks):
            return None
        self.held[key] = self.pool.allocate(num_blocks)
        return self.held[key]

    def release_held(self, key: str) -> bool:
        """Frees what `key` holds; idempotent."""
        blocks = self.held.pop(key, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        lease_key: str,
        num_prior_output_tokens: int = 0,
    ) -> None:
        """Joins a request whose prompt KV already sits in the blocks held under `lease_key`
        and whose first token was sampled elsewhere; it runs from the next step with room in the batch.
        `num_prior_output_tokens`: as in add_request."""
        prompt = self._validate(prompt_token_ids, params)
        _check_prior(num_prior_output_tokens, prompt)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        blocks = self.held.get(lease_key)
        needed = -(-len(prompt) // self.pool.block_size)
        if blocks is None or len(blocks) < needed:
            raise ValueError(f"lease {lease_key!r} holds {len(blocks or [])} blocks; the prompt needs {needed}")
        self._add_grammar(request_id, params, [*prompt[len(prompt) - num_prior_output_tokens :], first_token])
        del self.held[lease_key]
        request = Request(
            request_id, prompt, params, arrival_time=self.clock(), block_ids=blocks,
            num_prior_output_tokens=num_prior_output_tokens,
        )
        request.token_ids.append(first_token)
        request.num_computed_tokens = len(prompt)
        self.scheduler.commit_computed_blocks(request)
        self.scheduler.add_ready(request)

    def adopt_draft_prompt(self, request_id: str) -> tuple[torch.Tensor, list[int]] | None:
        """For a running request whose draft-model KV of the prompt was computed elsewhere: the draft
        cache and the blocks the caller now writes that KV into, in order, before the next step
        (then the draft does not compute the prompt here). None: this engine drafts with no model,
        or its draft pool has no room now."""
        if not isinstance(self.proposer, DraftModelProposer):
            return None
        request = self.scheduler.requests[request_id]
        blocks = self.proposer.adopt_prompt(request_id, request.token_ids[: request.num_prompt_tokens])
        return None if blocks is None else (self.proposer.kv_caches, blocks)

    @property
    def draft_kv(self) -> tuple[torch.Tensor, str] | None:
        """The draft model's KV cache and fingerprint (engine/spec/draft_load.py); None without one."""
        if not isinstance(self.proposer, DraftModelProposer):
            return None
        return self.proposer.kv_caches, self.proposer.fingerprint

    def has_unfinished(self) -> bool:
        """Requests live. NOTE: an in-flight step's live requests are live here, so a caller that
        steps until this is False reads every token; an in-flight step with none (all aborted) is
        left unread: the next step drops it."""
        return self.scheduler.num_unfinished > 0

    # ---- the step
    def step(self) -> list[StepOutput]:
        gate, batch = self.draft_gate, len(self.scheduler.running)
        limit = self.config.speculative.disable_above_batch_size
        if gate is None:
            outputs = self._step()
        elif limit is not None and batch > limit:  # NOTE: past the cap no step drafts and the gate is not asked
            outputs = self._step()
            gate.unmeasured(drafted=False)
        else:
            prompted, self._step_drafted, self._step_prompted = self._step_prompted, False, False
            start = self.clock()
            outputs = self._step()
            # NOTE: an asynchronous call returns the step before it: one that computed prompt tokens counts too
            if batch and not (prompted or self._step_prompted):
                tokens = sum(len(o.new_token_ids) for o in outputs)
                gate.observe(batch, self._step_drafted, self.clock() - start, tokens)
        self.step_timer.collect(self.rates)  # NOTE: after the reads: the steps they waited for are timed by now
        return outputs

    def _prompt_budget(self) -> int | None:
        """The prompt tokens a step may add beside decoding requests within the ITL budget
        (`itl_budget_ms`), from the measured rates; None: no cap (or none measured)."""
        budget_ms = self.itl_budget_ms
        rates = self.rates
        if budget_ms is None or rates.decode_step_s <= 0 or rates.prefill_tokens_per_s <= 0:
            return None
        room_s = budget_ms / 1e3 - rates.decode_step_s
        return max(self.pool.block_size, int(room_s * rates.prefill_tokens_per_s))

    def _step(self) -> list[StepOutput]:
        if self.async_scheduling and not self._drafts_now():
            if self.proposer is not None:
                self.proposer.skip()
            return self._step_async()
        if self._inflight is not None:
            # From asynchronous steps to a drafting one: this call only reads the step in flight
            # (its outputs), so drafting starts from every token in place.
            prev, self._inflight = self._inflight, None
            return self._resolve(prev)[0]
        mark = self.step_timer.begin()  # NOTE: a synchronous step's drafting is part of its time
        self._draft()
        out = self.scheduler.schedule(prompt_budget=self._prompt_budget())
        self._step_prompted = out.num_prompt_tokens > 0
        if not out.scheduled and self.has_unfinished() and not self.scheduler.running:
            raise RuntimeError("the scheduler admitted nothing with nothing running: the KV cache is too small")
        sampled = self._execute(out)
        if out.scheduled:
            self.step_timer.end(mark, out.num_prompt_tokens, out.num_decode_rows)
        return self._post_process(out, sampled)

    def _step_async(self) -> list[StepOutput]:
        """The module docstring's four stages; returns the previous step's outputs."""
        prev, self._inflight = self._inflight, None
        outputs: list[StepOutput] = []
        if prev is not None and prev.needs_tokens_first:
            outputs, prev = self._resolve(prev)[0], None
        out = self.scheduler.schedule(prev.ending if prev is not None else frozenset(), self._prompt_budget())
        self._step_prompted = out.num_prompt_tokens > 0
        if not out.scheduled and prev is None and self.scheduler.num_unfinished and not self.scheduler.running:
            raise RuntimeError("the scheduler admitted nothing with nothing running: the KV cache is too small")
        pending, sampling = None, []
        if out.scheduled:
            mark = self.step_timer.begin()
            logits = self._forward(out, prev)
            sampling = [s for s in out.scheduled if s.will_sample]
            mask = None
            if self._constrains(sampling):
                if prev is not None:
                    # A grammar's mask follows N's tokens: the host reads them and sends the fill to
                    # the grammar process; the draw is queued behind the fill's gate.
                    (outputs, mask), prev = self._resolve(prev, sampling), None
                else:
                    mask = self._mask(sampling)
            if sampling:
                pending = self.sampler.launch(logits, [_row(s.request) for s in sampling], self.generator, mask)
            self.step_timer.end(mark, out.num_prompt_tokens, out.num_decode_rows)
        if prev is not None:
            outputs = self._resolve(prev)[0]
        if out.scheduled:
            self._inflight = self._book(out, sampling, pending)
        return outputs

    def _constrains(self, sampling: Sequence[ScheduledRequest]) -> bool:
        """Whether a request of the draw follows a grammar."""
        return bool(self.grammars) and any(s.request.request_id in self.grammars for s in sampling)

    def _forward(self, out: SchedulerOutput, prev: _Inflight | None) -> torch.Tensor:
        """Queues the step's forward; reads nothing back. Its logits."""
        patch = None
        if prev is not None:
            rows = {s.request.request_id: i for i, s in enumerate(prev.sampling)}
            dst: list[int] = []
            src: list[int] = []
            position = 0
            for s in out.scheduled:
                request = s.request
                if request.token_ids[-1] == PLACEHOLDER:
                    # NOTE: only a request sampled in the last step carries one, and it computes
                    # exactly that token now.
                    assert s.num_new_tokens == 1, "a placeholder is always a decode step's only input"
                    dst.append(position)
                    src.append(rows[request.request_id])
                position += s.num_new_tokens
            if dst:
                assert prev.pending is not None
                patch = TokenPatch(prev.pending.token_ids, dst, src)
        return self.runner.execute(out.scheduled, patch)

    def _book(self, out: SchedulerOutput, sampling: list[ScheduledRequest], pending: PendingSample | None) -> _Inflight:
        """A launched step's KV counts and commits, and its placeholders; after the previous step's
        tokens are in place. Requests finished meanwhile are skipped."""
        for victim in out.preempted:
            self._drop_proposer_state(victim.request_id)
        self.scheduler.advance(out)
        ending = set()
        needs_tokens_first = False
        for s in sampling:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.token_ids.append(PLACEHOLDER)
            if self._ends_by_length(request, len(request.token_ids)):
                ending.add(request.request_id)
            needs_tokens_first = needs_tokens_first or request.hold_kv or has_penalty(request.params)
        return _Inflight(sampling, pending, frozenset(ending), needs_tokens_first)

    def _resolve(
        self, step: _Inflight, then: Sequence[ScheduledRequest] = ()
    ) -> tuple[list[StepOutput], TokenMask | None]:
        """Reads a launched step's tokens into place of its placeholders; its StepOutputs, and the mask
        of `then` (the next draw's requests). The constrained requests' matchers take the tokens and
        fill that mask in the grammar process while this thread builds the outputs and goes on: the
        mask comes back still filling (the draw that uses it waits for it on the device)."""
        if step.pending is None:
            return [], self._mask(then)
        started = time.perf_counter()
        result = self.sampler.finish(step.pending)
        self.wait_seconds += time.perf_counter() - started
        mask = None
        if self.grammars:
            tokens = [(s.request.request_id, [result.token_ids[i]]) for i, s in enumerate(step.sampling)
                      if not s.request.is_finished and s.request.request_id in self.grammars]
            if tokens or then:
                mask = self.grammars.submit(tokens, [s.request.request_id for s in then])
        outputs: list[StepOutput] = []
        for i, s in enumerate(step.sampling):
            request = s.request
            if request.is_finished:
                continue  # aborted, or stopped by its previous token: this draw is dropped
            token = result.token_ids[i]
            assert request.token_ids[-1] == PLACEHOLDER, "a sampled request carries its placeholder"
            request.token_ids[-1] = token
            status = self._stop_status(request, token)
            logprobs, top_logprobs = _one(result.logprobs[i], result.top_logprobs[i])
            outputs.append(self._report(request, [token], status, logprobs, top_logprobs))
        return outputs, mask

    def _drafts_now(self) -> bool:
        """Whether this step drafts: a proposer, a running batch no larger than
        disable_above_batch_size, and the draft gate's answer for that batch (no gate: every such batch)."""
        if self.proposer is None:
            return False
        limit, batch = self.config.speculative.disable_above_batch_size, len(self.scheduler.running)
        gate = self.draft_gate
        return (limit is None or batch <= limit) and (gate is None or gate.drafts(batch))

    def _draft(self) -> None:
        """Drafts for the decoding requests without a draft, unless the batch is too large to gain."""
        if self.proposer is None:
            return
        spec = self.config.speculative
        running = self.scheduler.running
        if not self._drafts_now():
            for request in running:
                request.draft = None
            self.proposer.skip()
            return
        asks: list[DraftRequest] = []
        for r in running:
            if r.draft is not None or r.num_computed_tokens != r.num_tokens - 1:
                continue
            # NOTE: a step yields up to K+1 tokens: never past max_tokens or the longest sequence.
            k = min(
                adaptive.num_draft_tokens(spec, r),
                r.params.max_tokens - r.num_output_tokens - 1,
                self.max_seq_tokens - r.num_tokens - 1,
            )
            if k >= 1:
                asks.append(
                    DraftRequest(r.request_id, r.token_ids, r.num_prompt_tokens, r.params, r.num_prior_output_tokens, k)
                )
        if asks:
            self._step_drafted = True
            for ask, draft in zip(asks, self.proposer.propose(asks, self.generator)):
                self.scheduler.requests[ask.request_id].draft = draft
        else:
            self.proposer.skip()

    def _execute(self, out: SchedulerOutput) -> list[_Sampled]:
        """One _Sampled per sampling request, in scheduled order."""
        if not out.scheduled:
            return []
        return self._sample(out, self.runner.execute(out.scheduled))

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[_Sampled]:
        sampling = [s for s in out.scheduled if s.will_sample]
        if not sampling:
            return []
        if not any(s.num_spec_tokens for s in sampling):
            result = self.sampler(logits, [_row(s.request) for s in sampling], self.generator, self._mask(sampling))
            return [
                _Sampled([t], *_one(result.logprobs[i], result.top_logprobs[i])) for i, t in enumerate(result.token_ids)
            ]
        return self._execute_speculative(sampling, logits)

    def _execute_speculative(self, sampling: list[ScheduledRequest], logits: torch.Tensor) -> list[_Sampled]:
        """Plain rows through the sampler, verifying rows (K+1 logits rows each) through verify."""
        plain_rows: list[int] = []  # logits rows
        verify_rows: list[int] = []
        plain: list[int] = []  # indexes into sampling
        verifying: list[int] = []
        row = 0
        for i, s in enumerate(sampling):
            if s.num_spec_tokens:
                verifying.append(i)
                verify_rows.extend(range(row, row + s.num_spec_tokens + 1))
            else:
                plain.append(i)
                plain_rows.append(row)
            row += s.num_spec_tokens + 1
        results: list[_Sampled | None] = [None] * len(sampling)
        if plain:
            rows = [_row(sampling[i].request) for i in plain]
            result = self.sampler(logits.index_select(0, upload(plain_rows, torch.long, logits.device)), rows,
                                  self.generator, self._mask([sampling[i] for i in plain]))
            for j, i in enumerate(plain):
                results[i] = _Sampled([result.token_ids[j]], *_one(result.logprobs[j], result.top_logprobs[j]))
        vrows = []
        for i in verifying:
            s = sampling[i]
            draft, k = s.request.draft, s.num_spec_tokens
            assert draft is not None
            probs = draft.probs[:k] if draft.probs is not None else None
            head = draft.head(k)  # NOTE: read only if this verification needs the values on the host
            vrows.append(VerifyRow(_row(s.request), head, probs, head.on_device))
        # NOTE: no gather when every row verifies (the common case); uploads never wait for the device.
        verifying_logits = (logits if not plain
                            else logits.index_select(0, upload(verify_rows, torch.long, logits.device)))
        # NOTE: only a constrained row's drafts are read on the host here: its matcher walks them.
        mask = self.grammars.mask_drafts([(sampling[i].request.request_id, vr.draft_token_ids)
                                          for i, vr in zip(verifying, vrows)]) if self.grammars else None
        launched = self.sampler.launch_verify(verifying_logits, vrows, self.generator, mask)
        if isinstance(launched, PendingVerify) and self.proposer is not None and self._drafts_now():
            # The next step's drafts, queued on the device before this step's tokens are read.
            self.proposer.chain([sampling[i].request.request_id for i in verifying], launched.out, self.generator)
        verified = self.sampler.finish_verify(launched)
        for j, i in enumerate(verifying):
            results[i] = _Sampled(
                verified.token_ids[j], verified.logprobs[j], verified.top_logprobs[j], verified.num_accepted[j]
            )
        return results  # type: ignore[return-value]

    def _post_process(self, out: SchedulerOutput, sampled: list[_Sampled]) -> list[StepOutput]:
        for victim in out.preempted:
            self._drop_proposer_state(victim.request_id)
        self.scheduler.advance(out)
        outputs: list[StepOutput] = []
        accepted: list[tuple[str, list[int]]] = []  # the constrained requests' new tokens: one message
        for s, sample in zip([s for s in out.scheduled if s.will_sample], sampled):
            request = s.request
            request.draft = None  # drafted for the tokens before this step's
            if s.num_spec_tokens:
                new_tokens, status = self._append_tokens(request, sample.token_ids)
                self._accept_verified(s, sample, new_tokens)
            else:  # NOTE: one token: the common step, without _append_tokens' loop
                new_tokens = sample.token_ids
                request.token_ids.append(new_tokens[0])
                status = self._stop_status(request, new_tokens[0])
            if request.request_id in self.grammars:
                accepted.append((request.request_id, new_tokens))
            n = len(new_tokens)
            outputs.append(
                self._report(
                    request, new_tokens, status,
                    sample.logprobs[:n] if sample.logprobs is not None else None,
                    sample.top_logprobs[:n] if sample.top_logprobs is not None else None,
                )
            )
        if accepted:
            self.grammars.accept(accepted)
        return outputs

    def _mask(self, sampling: Sequence[ScheduledRequest]) -> TokenMask | None:
        """The draw's token mask: the constrained requests' allowed tokens (None: none is constrained)."""
        return self.grammars.mask([s.request.request_id for s in sampling]) if self.grammars and sampling else None

    def _report(
        self,
        request: Request,
        new_tokens: list[int],
        status: RequestStatus | None,
        logprobs: list[float] | None,
        top_logprobs: list[list[tuple[int, float]]] | None,
    ) -> StepOutput:
        """A request's StepOutput for the step's new tokens; a stop retires it first (its blocks
        freed, or, with hold_kv, held under its id for the caller)."""
        kept = None
        if status is not None:
            blocks = self.scheduler.finish(request, status)
            self._drop_request_state(request.request_id)
            if request.hold_kv:
                kept = self.held[request.request_id] = blocks
        return StepOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            finish_reason=status.value if status is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv_block_ids=kept,
        )

    def _append_tokens(self, request: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Appends tokens one by one until a stop condition holds; returns those appended and the stop."""
        for n, token in enumerate(token_ids, start=1):
            request.token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                return token_ids[:n], status
        return token_ids, None

    def _accept_verified(self, s: ScheduledRequest, sample: _Sampled, new_tokens: list[int]) -> None:
        """KV stays for the step's first position and the accepted drafts that were kept; the
        rest rolls back. Counts the verification and feeds the request's acceptance estimate."""
        num_kept_drafts = min(sample.num_accepted, len(new_tokens))
        self.scheduler.accept_verified(s.request, 1 + num_kept_drafts)
        self.spec_counters.record(s.num_spec_tokens, sample.num_accepted, len(new_tokens))
        adaptive.observe(s.request, s.num_spec_tokens, sample.num_accepted)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """The stop a just-appended token brings, if any."""
        params = request.params
        if params.grammar is not None and token in self.eos_token_ids:
            # NOTE: a grammar's mask allows EOS only where it is complete, and ends the output there
            # whatever min_tokens or ignore_eos say.
            request.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
        num_tokens = len(request.token_ids)
        num_output = num_tokens - len(request.prompt_token_ids)
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids
        ):
            request.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if self._ends_by_length(request, num_tokens) else None

    def _ends_by_length(self, request: Request, num_tokens: int) -> bool:
        """Whether a request of num_tokens tokens (prompt and output) has reached max_tokens or
        the longest sequence."""
        num_output = num_tokens - len(request.prompt_token_ids)
        return num_output >= request.params.max_tokens or num_tokens >= self.max_seq_tokens

    @property
    def kv_scales_kind(self) -> str:
        """An FP8 cache's scales: "checkpoint" (per layer, read from it) or "unit"; "" for another cache."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return ""
        return "checkpoint" if self.kv_scales is not None else "unit"

    def stats(self) -> EngineStats:
        retries, frees = allocator_counts(self.device)
        others = RankReport()
        if self._rank_stats is not None and self.runner.leader is not None and self.ranks_alive:
            others = self._rank_stats.report()
        return EngineStats(
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.ready),
            num_running=len(self.scheduler.running),
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_spec_draft_tokens=self.spec_counters.num_draft_tokens,
            num_spec_accepted_tokens=self.spec_counters.num_accepted_tokens,
            num_spec_verifications=self.spec_counters.num_verifications,
            num_spec_rejections=self.spec_counters.num_rejections,
            num_spec_emitted_tokens=self.spec_counters.num_emitted_tokens,
            num_spec_gate_overturns=self.draft_gate.num_overturns if self.draft_gate is not None else 0,
            num_queued_prompt_tokens=sum(
                r.num_prompt_tokens - r.num_computed_tokens for r in (*self.scheduler.waiting, *self.scheduler.running)
                if r.num_computed_tokens < r.num_prompt_tokens),
            decode_step_s=self.rates.decode_step_s,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            num_prompt_tokens_computed=self.rates.num_prompt_tokens,
            num_prompts_started=self.scheduler.num_prompts_started,
            kv_bytes_per_token=self.block_bytes * (self.tp.shard.size if self.tp is not None else 1)
            // self.pool.block_size,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            weights=self.weights, kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_scales=self.kv_scales_kind, parallel=self.parallel,
            num_alloc_retries=retries + others.alloc_retries, num_device_frees=frees + others.device_frees,
            step_device_seconds=self.rates.device_seconds, step_wait_seconds=self.wait_seconds,
            grammar_work_seconds=self.grammars.work_seconds,
            follower_forward_seconds=others.forward_seconds, follower_call_seconds=others.call_seconds,
            follower_longest_call_seconds=others.longest_call_seconds, follower_gc_seconds=others.gc_seconds,
            follower_longest_gc_seconds=others.longest_gc_seconds,
        )

    # ---- invariants
    def check_integrity(self) -> None:
        """The pool's own table holds, and its holders are exactly the live requests' and the
        held keys' blocks."""
        self.pool.check_integrity()
        total_refs = sum(self.pool.ref_count(b) for b in range(self.pool.num_blocks))
        claimed = self.scheduler.num_held_blocks_by_requests() + sum(len(b) for b in self.held.values())
        if total_refs != claimed:
            raise IntegrityError(f"the pool counts {total_refs} block holders, the requests claim {claimed}")
        if self.proposer is not None:
            self.proposer.check_integrity(self.scheduler.requests.keys())


def _row(request: Request) -> SamplingRow:
    return SamplingRow(request.params, request.prompt_token_ids, request.output_view(), request.num_prior_output_tokens)


def _one(
    logprob: float | None, top: list[tuple[int, float]] | None
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    return ([logprob], [top]) if logprob is not None else (None, None)  # type: ignore[list-item]


def _check_prior(num_prior_output_tokens: int, prompt: Sequence[int]) -> None:
    if not 0 <= num_prior_output_tokens <= len(prompt):
        raise ValueError(
            f"num_prior_output_tokens is {num_prior_output_tokens}; it counts tokens at the end of the prompt, "
            f"so it must be in [0, {len(prompt)}] (the prompt's length)"
        )
