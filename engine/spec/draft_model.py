"""A draft model: a smaller model of the target's tokenizer, run in the engine's process on the
target's device with a paged KV cache and a BlockPool of its own (prefix caching off).

Per request it keeps the token ids whose KV its cache holds. Each `propose` first rolls that back
to the longest prefix the request still shares (the target rejected the rest; the blocks past it
are freed), then runs K forward passes over all requests at once: the first catches up on the
tokens the target accepted since (the whole prompt for a newcomer, within the step's token budget)
and drafts d_1; the others feed d_{i-1} and draft d_i. Drafts are sampled from the draft's logits
processed as the target's are (the engine's Sampler), so verification can use their probabilities.

On CUDA a step's K passes and their draws replay as one graph (engine/spec/draft_loop.py), whose
first pass feeds each request's last two tokens; requests further behind (a newcomer's prompt, or
steps decoded without drafting) catch up on the rest in one forward before it. Steps the loop does
not serve (penalties, seeds, truncated sampling) run pass by pass, replaying the draft runner's
decode graphs (engine/cuda_graphs.py) as the target's do when the pass is short.

Chained drafting (`chain`): once the target's verification of a loop run's drafts is queued, the
next run of the same rows is queued behind it, its inputs moved on the device by the verification's
results, so the device drafts step N + 1 while the host reads step N and plans. The next `propose`
adopts those drafts for the requests that ask again (their tokens then match what the device
assumed: the engine appends exactly the verified tokens to a request that goes on).

Does not know the target's blocks or scheduler: a request it cannot give blocks to gets no draft.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engine.cuda_graphs import cuda_graphs_enabled
from engine.kv_cache import BlockPool, IntegrityError, allocate_kv_tensors, bytes_per_block
from engine.request import DeviceTokens, Draft
from engine.pinned import Download
from engine.runner import ForwardSeq, ModelRunner, TokenPatch
from engine.sampler import SamplingRow, has_penalty
from engine.spec.base import DraftRequest, ProposerContext, register_proposer
from engine.spec.draft_load import load_draft
from engine.spec.draft_loop import MAX_CATCH_UP, DraftLoopGraphs, LoopRow
from engine.warmup import warm_up_runner

PLACEHOLDER = -1  # a drafted token still on the device: read once, when first used (_DraftRead)


@dataclass
class _DraftSeq:
    token_ids: list[int] = field(default_factory=list)  # inputs whose KV the draft cache holds, from position 0
    block_ids: list[int] = field(default_factory=list)
    num_trusted: int = 0  # leading token_ids known to be the request's own (the rest were drafted)


@dataclass
class _Job:
    request: DraftRequest
    seq: _DraftSeq
    num_new: int  # tokens fed in the first pass
    is_drafting: bool  # False: a partial catch-up, no draft this step
    start: int = -1  # a loop row's last token's position (its logits drew d_1); -1 elsewhere
    feeds_seq: bool = True  # the draft cache's inputs (seq.token_ids) end with this job's fed drafts
    token_ids: list[int] = field(default_factory=list)  # drafted so far (the loop graph drafts K for every job)
    probs: list[torch.Tensor] = field(default_factory=list)  # [vocab] each (pass by pass)
    # A loop row's distributions: its run's [K, rows, vocab] (a copy of the loop's output) and its row
    row_dists: tuple[torch.Tensor, int] | None = None
    draft_ids: list[int] | None = None  # the draft proposed: token_ids' first request.max_draft_tokens
    read: _DraftRead | None = None  # the one read of its tokens, while on the device

    def proposed(self) -> list[int]:
        """The draft's list of tokens (filled in place when read, see _DraftRead)."""
        k = self.request.max_draft_tokens
        if len(self.token_ids) <= k:
            return self.token_ids
        if self.draft_ids is None:
            self.draft_ids = self.token_ids[:k]
        return self.draft_ids


@register_proposer
class DraftModelProposer:
    name: ClassVar[str] = "draft"

    def __init__(self, context: ProposerContext) -> None:
        self.context = context
        draft = load_draft(context.config, context.model, context.target_arch, context.device, context.dtype)
        self.model, self.arch, self.backend = draft.model, draft.arch, draft.backend
        self.fingerprint = draft.fingerprint  # two workers exchange a draft's KV only if theirs agree
        self.kv_bytes_per_block = bytes_per_block(self.arch, context.block_size, context.dtype)
        self.seqs: dict[str, _DraftSeq] = {}
        self.pool: BlockPool | None = None
        self.runner: ModelRunner | None = None
        self.loop: DraftLoopGraphs | None = None  # all K passes in one graph (CUDA), set by bind
        self._unread: list[_DraftRead] = []  # proposals' tokens still on the device
        # The loop's last run's rows, in order, while `chain` may continue them (None: a row no
        # request drafts from any more), and a chained run's rows until the next propose adopts them.
        self._looped: list[_Job | None] = []
        self._chained: list[_Job | None] = []
        self.num_chained = 0  # chained runs queued

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        ctx = self.context
        bs, k = ctx.block_size, ctx.config.num_draft_tokens
        # The draft holds at most what the target holds, plus its lookahead of up to K tokens a request.
        lookahead = ctx.max_num_seqs * (-(-k // bs) + 1)
        num_blocks = ctx.config.draft_num_blocks or num_target_blocks + lookahead
        kv = allocate_kv_tensors(self.arch, num_blocks, bs, ctx.dtype, ctx.device)
        self.pool = BlockPool(num_blocks, bs, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, kv, self.backend, ctx.device)
        warm_up_runner(self.runner, max_seq_tokens + k, ctx.max_num_seqs, ctx.max_num_batched_tokens)
        if ctx.cuda_graph_max_rows is not None and cuda_graphs_enabled(ctx.model, ctx.device, self.backend):
            # Drafted positions run up to K - 1 past the target's longest sequence.
            self.runner.capture_decode_graphs(ctx.cuda_graph_max_rows, max_seq_tokens + k)
            limit = ctx.config.disable_above_batch_size
            max_batch = max(1, min(ctx.max_num_seqs, limit if limit is not None else ctx.max_num_seqs))
            staging = self.runner.staging
            self.loop = DraftLoopGraphs(self.model, kv, self.backend, staging, k, max_batch, max_seq_tokens + k)
            self.loop.capture()

    # ---- per-request state
    @property
    def kv_caches(self) -> torch.Tensor:
        """The draft's KV cache [layers, 2, blocks, block_size, kv_heads, head_dim] (after bind)."""
        assert self.runner is not None, "bind() first"
        return self.runner.kv_caches

    def adopt_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> list[int] | None:
        """Blocks for a prompt whose draft KV was computed elsewhere (a prefill worker's draft
        prefill): the caller writes that KV into them, in order, before the next `propose`, which then
        catches up only on what follows the prompt. None: no blocks free now (the request's first
        drafting step then computes the prompt here, as for any newcomer)."""
        if request_id in self.seqs:
            raise ValueError(f"the draft model already holds state for request {request_id!r}")
        seq = _DraftSeq(list(prompt_token_ids), num_trusted=len(prompt_token_ids))
        if not self._reserve(seq, len(seq.token_ids), keep=self.seqs):  # NOTE: drops no other request's state
            return None
        self.seqs[request_id] = seq
        return seq.block_ids

    def drop(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and self.pool is not None:
            self.pool.free(seq.block_ids)

    def _sync(self, request: DraftRequest) -> _DraftSeq:
        """The request's state, rolled back to the prefix of its tokens the draft still shares,
        leaving at least the last token to feed (its logits draft d_1)."""
        seq = self.seqs.setdefault(request.request_id, _DraftSeq())
        tokens = request.token_ids
        common = seq.num_trusted
        limit = min(len(seq.token_ids), len(tokens) - 1)
        while common < limit and seq.token_ids[common] == tokens[common]:
            common += 1
        common = min(common, limit)
        del seq.token_ids[common:]
        seq.num_trusted = common
        self._truncate_blocks(seq)
        return seq

    def _truncate_blocks(self, seq: _DraftSeq) -> None:
        assert self.pool is not None
        num_kept = -(-len(seq.token_ids) // self.pool.block_size)
        self.pool.free(seq.block_ids[num_kept:])
        del seq.block_ids[num_kept:]

    def _reserve(self, seq: _DraftSeq, num_positions: int, keep: Collection[str]) -> bool:
        """Blocks for positions [0, num_positions); frees idle requests' states when short."""
        assert self.pool is not None
        needed = max(0, -(-num_positions // self.pool.block_size) - len(seq.block_ids))
        if not self.pool.can_allocate(needed):
            for request_id in [r for r in self.seqs if r not in keep]:
                self.drop(request_id)
        if not self.pool.can_allocate(needed):
            return False
        seq.block_ids.extend(self.pool.allocate(needed))
        return True

    # ---- drafting
    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        """K passes queued back to back, in one graph replay when the loop graph serves the batch
        (`_loop`), else pass by pass (`_pass_by_pass`). The drafted tokens stay on the device: each
        pass takes its inputs from the previous pass's draws there, and the drafts are read once,
        when first used (engine/request.py Draft). Requests with penalties need each drafted token's
        value for the next draw: with one among them, every pass is read before the next."""
        assert self.runner is not None, "bind() first"
        chained = {j.request.request_id: j for j in self._chained if j is not None}
        adopted = {r.request_id: self._adopt(r, chained[r.request_id]) for r in requests
                   if r.request_id in chained and self._continues(r, chained[r.request_id])}
        drafts = {r.request_id: self._draft_of(r, adopted[r.request_id]) for r in requests if r.request_id in adopted}
        rows, self._chained, self._looped = self._chained, [], []
        if len(adopted) == len(requests):
            # The chained run's rows, those not adopted left out: chain() may continue them.
            self._looped = [j if j is not None and j.request.request_id in adopted else None for j in rows]
            return [drafts[r.request_id] for r in requests]
        requests_left = [r for r in requests if r.request_id not in adopted]
        self._read_pending()  # NOTE: before _plan: rolling back compares the cache's inputs
        jobs = self._plan(requests_left, keep={r.request_id for r in requests})
        drafting = [j for j in jobs if j.is_drafting]
        on_device = not any(has_penalty(j.request.params) for j in drafting)
        passes: list[tuple[torch.Tensor, list[_Job]]] = []  # each pass's draws [active jobs] on the device, its jobs
        if not (on_device and drafting and len(drafting) == len(jobs) and self._loop(drafting, passes, generator)):
            self._pass_by_pass(jobs, drafting, passes, generator, on_device)
        if on_device and passes:
            self._unread.append(_DraftRead(drafting, passes))
        by_id = {j.request.request_id: j for j in drafting}
        drafts.update((r.request_id, self._draft_of(r, by_id[r.request_id])) for r in requests if r.request_id in by_id)
        return [drafts.get(r.request_id) for r in requests]

    def _draft_of(self, r: DraftRequest, j: _Job) -> Draft:
        """The request's Draft of a job's tokens: its first max_draft_tokens, their distributions
        (random rows), and where they lie on the device until read."""
        k = r.max_draft_tokens
        if r.params.is_greedy:
            probs = None
        elif j.row_dists is not None:
            probs = j.row_dists[0][:k, j.row_dists[1]]  # [k, vocab], rows strided: verification takes it so
        else:
            probs = torch.stack(j.probs[:k])
        if j.read is None:
            return Draft(j.token_ids, probs)
        # NOTE: j.proposed() holds placeholders until the read fills it in place
        proposed = j.proposed()
        return Draft(proposed, probs, DeviceTokens(j.read.tokens, j.read.index[id(j)][: len(proposed)]), j.read.read)

    # ---- chained drafting
    def chain(self, request_ids: Sequence[str], verified: torch.Tensor, generator: torch.Generator | None) -> bool:
        """Queues the loop's next run for the rows of its last run, which are the requests verified
        now (`request_ids`, in the order of `verified`: engine/sampling_kernels.verify's output, on
        the device): their drafts for the step after this one, before the host reads this one's
        results. False (nothing queued) when those are not the same requests, a row would pass the
        loop's context, or the draft pool cannot cover the furthest a row can reach."""
        looped, self._looped = self._looped, []
        loop = self.loop
        live = [j for j in looped if j is not None]
        if loop is None or not live or len(request_ids) != len(live):
            return False
        order = {rid: v for v, rid in enumerate(request_ids)}
        if any(j.request.request_id not in order for j in live):
            return False
        k = loop.num_passes
        # A row's next run writes up to position start + 2K (m = K accepted, then K - 1 fed drafts).
        if any(j.start + 2 * k + 1 > loop.max_context for j in live):
            return False
        if not all(self._reserve(j.seq, j.start + 2 * k + 1, order) for j in live):
            return False
        rows: list[_Job | None] = []
        for j in looped:
            if j is None:
                rows.append(None)
                continue
            # The draft cache's inputs go back to the request's own tokens, which the next run's
            # inputs follow on from: this run's drafts (placeholders still) are no longer fed there.
            j.feeds_seq = False
            del j.seq.token_ids[j.start + 1 :]
            j.seq.num_trusted = len(j.seq.token_ids)
            rows.append(_Job(j.request, j.seq, 0, True, start=j.start, feeds_seq=False,
                             token_ids=[PLACEHOLDER] * k))
        is_random = any(not j.request.params.is_greedy for j in live)
        tokens, dists = loop.chain(verified, [-1 if j is None else order[j.request.request_id] for j in looped],
                                   [[] if j is None else j.seq.block_ids for j in looped], is_random, generator)
        if is_random:
            _keep_row_dists(rows, dists)
        self._unread = [pending for pending in self._unread if not pending.is_done]
        self._unread.append(_DraftRead(rows, [(tokens[i], rows) for i in range(k)]))
        self._chained = rows
        self.num_chained += 1
        return True

    def skip(self) -> None:
        """Drops the chained run: a step decoded without verifying it, so its rows' drafts and the
        draft KV it wrote past each row's start follow tokens other than the request's. Its rows'
        caches trust what they held before it (chain() cut them back), so the next proposal catches
        up from there. NOTE: adopted instead, a row that the verification and the steps after it left
        within the run's reach drafted from the wrong position (test_draft_loop.py's
        test_a_chained_run_is_dropped_when_steps_decode_without_drafting)."""
        self._chained, self._looped = [], []

    def _continues(self, r: DraftRequest, j: _Job) -> bool:
        """Whether a chained row's request went on as its run assumed: 1 to K + 1 tokens past its start
        (the verified ones; a request that stopped leaves instead)."""
        assert self.loop is not None
        is_ours = self.seqs.get(r.request_id) is j.seq
        return is_ours and j.start + 1 < len(r.token_ids) <= j.start + self.loop.num_passes + 2

    def _adopt(self, r: DraftRequest, j: _Job) -> _Job:
        """A chained row's drafts become the request's proposal: the draft cache holds the request's
        tokens and the fed drafts d_1 .. d_{K-1} (placeholders until read)."""
        assert self.loop is not None
        j.request, j.start = r, len(r.token_ids) - 1
        j.seq.token_ids.extend(r.token_ids[len(j.seq.token_ids) :])  # NOTE: chain() cut it back to its start
        j.seq.num_trusted = len(j.seq.token_ids)
        j.seq.token_ids.extend([PLACEHOLDER] * (self.loop.num_passes - 1))
        j.feeds_seq = True
        return j

    def _pass_by_pass(
        self,
        jobs: list[_Job],
        drafting: list[_Job],
        passes: list[tuple[torch.Tensor, list[_Job]]],
        generator: torch.Generator | None,
        on_device: bool,
    ) -> None:
        """Pass 1 catches up (the last token at least; the whole prompt for a newcomer, within the
        step's token budget) and drafts d_1 for the drafting jobs; pass i feeds d_{i-1}, drafts d_i."""
        assert self.runner is not None
        if not jobs:
            return
        fwd = [
            ForwardSeq(j.request.token_ids[len(j.seq.token_ids) : len(j.seq.token_ids) + j.num_new],
                       len(j.seq.token_ids), j.seq.block_ids, int(j.is_drafting))
            for j in jobs
        ]
        logits = self.runner.forward(fwd)
        for j in jobs:
            j.seq.token_ids.extend(j.request.token_ids[len(j.seq.token_ids) : len(j.seq.token_ids) + j.num_new])
            j.seq.num_trusted = len(j.seq.token_ids)
        if not drafting:
            return
        passes.append((self._sample(drafting, logits, generator, on_device), drafting))
        previous = drafting
        for i in range(1, max(j.request.max_draft_tokens for j in drafting)):
            active = [j for j in previous if j.request.max_draft_tokens > i]
            if on_device:
                # NOTE: `previous` keeps `active`'s order, so its row of job j is j's index there.
                where = {id(j): row for row, j in enumerate(previous)}
                patch = TokenPatch(passes[-1][0], list(range(len(active))), [where[id(j)] for j in active])
                fwd = [ForwardSeq([0], len(j.seq.token_ids), j.seq.block_ids, 1) for j in active]
            else:
                patch = None
                fwd = [ForwardSeq([j.token_ids[-1]], len(j.seq.token_ids), j.seq.block_ids, 1) for j in active]
            logits = self.runner.forward(fwd, patch)
            for j in active:
                j.seq.token_ids.append(j.token_ids[-1])  # a PLACEHOLDER on the device path, read later
            passes.append((self._sample(active, logits, generator, on_device), active))
            previous = active

    def _sample(
        self, jobs: list[_Job], logits: torch.Tensor, generator: torch.Generator | None, on_device: bool
    ) -> torch.Tensor:
        """Draws each job's next drafted token from its logits row, as the target would process it;
        returns them [jobs] on the device. on_device: the jobs' drafts get a PLACEHOLDER each (no
        job applies penalties, so no draw reads their values); else the values, read now."""
        rows = []
        for j in jobs:
            r = j.request
            output = list(r.token_ids[r.num_prompt_tokens :]) + j.token_ids
            # A seeded draft races with the target's noise for the same output position: the target
            # then accepts it as often as that coupling allows (engine/sampler.py).
            rows.append(SamplingRow(r.params, r.token_ids[: r.num_prompt_tokens], output, r.num_prior_output_tokens))
        token_ids, probs = self.context.sampler.launch_with_probs(logits, rows, generator)
        values = [PLACEHOLDER] * len(jobs) if on_device else token_ids.tolist()
        for j, token, p in zip(jobs, values, probs):
            j.token_ids.append(token)
            j.probs.append(p)
        return token_ids

    def _read_pending(self) -> None:
        """The proposals' drafted tokens, read now if no one asked for them (the draft cache's inputs
        hold placeholders until then)."""
        for pending in self._unread:
            pending.read()
        self._unread.clear()

    def _loop(
        self, drafting: list[_Job], passes: list[tuple[torch.Tensor, list[_Job]]], generator: torch.Generator | None
    ) -> bool:
        """All K passes through the loop graph, when it serves these jobs (engine/spec/draft_loop.py):
        their drafts get placeholders (read later) and the distributions they were drawn from. Every
        job drafts K (its blocks cover them, see _plan): a job proposing fewer (adaptive K) proposes
        the first ones, and the draft cache keeps the rest until the next step rolls them back. Jobs
        further behind than the loop's first pass reaches (a newcomer's prompt, steps decoded without
        drafting) catch up first, in one forward."""
        if self.loop is None:
            return False
        requests = [j.request for j in drafting]
        num_outputs = [len(r.token_ids) - r.num_prompt_tokens for r in requests]
        k = self.loop.num_passes
        if not self.loop.serves([r.params for r in requests], num_outputs, [r.max_draft_tokens for r in requests], k):
            return False
        self._catch_up([j for j in drafting if j.num_new > MAX_CATCH_UP])
        rows = []
        for r, j in zip(requests, drafting):
            start = len(r.token_ids) - 1
            temperature = 0.0 if r.params.is_greedy else r.params.temperature
            rows.append(LoopRow(start, (r.token_ids[start - 1], r.token_ids[start]), j.seq.block_ids, temperature))
        out = self.loop.run(rows, generator)
        if out is None:
            return False
        tokens, dists = out
        for r, j, row in zip(requests, drafting, rows):
            j.seq.token_ids.extend(r.token_ids[len(j.seq.token_ids) :])  # caught up
            j.seq.num_trusted = len(j.seq.token_ids)
            j.start = row.start
        self._looped = list(drafting)
        for j in drafting:
            j.seq.token_ids.extend([PLACEHOLDER] * (k - 1))  # d_1 .. d_{K-1} were fed
            j.token_ids.extend([PLACEHOLDER] * k)
        if any(not r.params.is_greedy for r in requests):
            _keep_row_dists(drafting, dists)
        passes.extend((tokens[i], drafting) for i in range(k))
        return True

    def _catch_up(self, behind: list[_Job]) -> None:
        """Feeds each job's tokens but its last MAX_CATCH_UP, in one forward without logits: the loop's
        first pass feeds those."""
        assert self.runner is not None
        if not behind:
            return
        fwd = []
        for j in behind:
            have, upto = len(j.seq.token_ids), len(j.request.token_ids) - MAX_CATCH_UP
            fwd.append(ForwardSeq(j.request.token_ids[have:upto], have, j.seq.block_ids, 0))
        self.runner.forward(fwd)
        for j, f in zip(behind, fwd):
            j.seq.token_ids.extend(f.token_ids)
            j.seq.num_trusted = len(j.seq.token_ids)
            j.num_new = MAX_CATCH_UP

    def _plan(self, requests: Sequence[DraftRequest], keep: Collection[str]) -> list[_Job]:
        """Rolls each request back, then gives blocks and the step's token budget: the requests with
        the least to catch up first; one that does not fit whole catches up in part, undrafted.
        keep: the requests whose draft state no shortage of blocks may drop."""
        synced = sorted(
            ((r, self._sync(r)) for r in requests), key=lambda rs: len(rs[0].token_ids) - len(rs[1].token_ids)
        )
        budget = self.context.max_num_batched_tokens
        jobs: list[_Job] = []
        for r, seq in synced:
            if budget <= 0:
                break
            num_new = len(r.token_ids) - len(seq.token_ids)
            is_drafting = num_new <= budget
            num_new = min(num_new, budget)
            # Drafting feeds num_new tokens, then d_1 .. d_{K-1}: the loop graph's K for every job.
            k = max(r.max_draft_tokens, self.loop.num_passes if self.loop is not None else 0)
            num_positions = len(seq.token_ids) + num_new + (k - 1 if is_drafting else 0)
            if not self._reserve(seq, num_positions, keep):
                continue
            budget -= num_new
            jobs.append(_Job(r, seq, num_new, is_drafting))
        return jobs

    # ---- invariants
    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        if self.pool is None:
            return
        self._read_pending()
        self.pool.check_integrity()
        stale = sorted(set(self.seqs) - set(live_request_ids))
        if stale:
            raise IntegrityError(f"the draft model holds state for requests no longer running: {stale[:8]}")
        unread = sorted(r for r, s in self.seqs.items() if PLACEHOLDER in s.token_ids)
        if unread:
            raise IntegrityError(f"the draft cache's inputs of {unread[:8]} hold drafted tokens never read back")
        claimed = sum(len(s.block_ids) for s in self.seqs.values())
        if claimed != self.pool.num_held_blocks:
            raise IntegrityError(
                f"the draft pool holds {self.pool.num_held_blocks} blocks, its requests claim {claimed}"
            )


def _keep_row_dists(rows: Sequence[_Job | None], dists: torch.Tensor) -> None:
    """Gives each job its row of a loop run's distributions [K, rows, vocab], copied once for the run: the
    loop's next run overwrites its output, and a draft left unscheduled waits for longer."""
    kept = dists.clone()
    for row, j in enumerate(rows):
        if j is not None:
            j.row_dists = (kept, row)


class _DraftRead:
    """A proposal's drafted tokens on the device (one flat tensor) and their one read back into
    place of the jobs' placeholders: in their drafts, and in the draft cache's inputs of
    d_1 .. d_{K-1}. A row of None in a pass (a chained run's row no request drafts from) is drawn
    and never read."""

    def __init__(
        self, drafting: Sequence[_Job | None], passes: Sequence[tuple[torch.Tensor, Sequence[_Job | None]]]
    ) -> None:
        # NOTE: a copy even of one pass: the loop graph's draws are views of its static output, which
        # its next run overwrites while an unscheduled request's draft may still be unread.
        self.tokens = torch.cat([t for t, _ in passes])  # [sum of pass sizes] int64
        self._download = Download(self.tokens)  # NOTE: a read waits for this proposal alone
        self.jobs = [j for j in drafting if j is not None]
        self.index: dict[int, list[int]] = {id(j): [] for j in self.jobs}  # a job's tokens in self.tokens
        offset = 0
        for tokens, active in passes:
            assert len(active) == len(tokens), "a pass draws one token per active job"
            for row, j in enumerate(active):
                if j is not None:
                    self.index[id(j)].append(offset + row)
            offset += len(active)
        for j in self.jobs:
            j.read = self
        self.is_done = False

    def read(self) -> None:
        if self.is_done:
            return
        self.is_done = True
        values = self._download.read()
        for j in self.jobs:
            # A job keeping fewer tokens than it was drawn for keeps the first ones
            j.token_ids[:] = [values[x] for x in self.index[id(j)][: len(j.token_ids)]]
            if j.draft_ids is not None:
                j.draft_ids[:] = j.token_ids[: len(j.draft_ids)]
            num_fed = len(j.token_ids) - 1  # d_1 .. d_{K-1} were fed to the draft model
            if num_fed and j.feeds_seq:
                j.seq.token_ids[-num_fed:] = j.token_ids[:num_fed]
