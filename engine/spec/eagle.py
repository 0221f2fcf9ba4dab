"""The EAGLE proposer: an EAGLE-1 head (engine/spec/eagle_head.py) drafts from the target's own
hidden states, one decoder layer a drafted token instead of a whole draft model.

Features. The target's runner hands every step's hidden states to `observe` (ModelRunner.observer).
Head position j needs h_j and the token x_{j+1}, so a position is fed once the token after it is
known. Per request the proposer keeps `fed` (head positions [0, fed) hold KV from the target's
features) and the features of the positions after it that the target has computed (`pending`). A
step that computes prompt tokens feeds what it can at once (all of a chunk but the prompt's last
position), so pending stays short; so does a request that runs long without drafts (fed once
MAX_PENDING positions wait). A verification's rows past what it accepts are superseded by the next
step's and cut.

KV. The head's cache has one layer and is indexed by the target's block ids: head position j lives
in the target's block of position j, so blocks that prefix caching shares carry the head's KV of the
request that computed them, and the target's pool frees both. Drafting writes up to K - 1 positions
past the request's last token, where the target may hold no block yet: those land in scratch blocks
after the target's, a fixed group per row of the proposal (their KV is read within the proposal
only; the next proposal feeds those positions again from the target's features). NOTE: a shared
block's head KV at a position whose next token differs between the requests sharing it (the last
position of one's prompt, the next prompt token of the other's) is the first request's: drafts after
it may be accepted less often, output stays exact.

Drafting (`propose`): on CUDA, all K passes replay in the draft model's loop graph
(engine/spec/draft_loop.py, run with the head as its model): after a forward of any positions that
waited before the last two, its first pass feeds positions n - 2 and n - 1 (x_{n-1}, x_n beside
h_{n-2}, h_{n-1}; n - 2 again, from the same inputs, when it was fed already) and draws d_1; pass i
feeds d_{i-1} with the f before it (EagleHead.compute_logits leaves f in the feature buffer) and
draws d_i. Rows the loop does not serve (penalties, seeds, truncation) draft pass by pass: pass 1
feeds the positions waiting up to n - 1, each later pass one position, through the head runner's
decode graphs, with the Sampler's draws. Drafts stay on the device until first read, as the draft
model's do.

Not here yet: chaining (`chain` queues nothing), tensor-parallel targets, and disaggregated
workers (the head's KV of a pushed prompt is not pushed).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from engine.attention import AttentionSpec, create_backend
from engine.cuda_graphs import cuda_graphs_enabled
from engine.kv_cache import IntegrityError, allocate_kv_tensors, bytes_per_block
from engine.pinned import upload
from engine.request import DeviceTokens, Draft
from engine.runner import ForwardSeq, ModelRunner, TokenPatch
from engine.sampler import has_penalty
from engine.scheduler import ScheduledRequest
from engine.spec.base import (DRAFT_PLACEHOLDER, DeviceDrafts, DraftRequest, ProposerContext, draw_drafts,
                              register_proposer)
from engine.spec.draft_load import draft_dir
from engine.spec.draft_loop import DraftLoopGraphs, LoopRow
from engine.spec.eagle_head import EagleHead, load_eagle_head
from engine.warmup import warm_up_runner

MAX_PENDING = 64  # positions whose features may wait for a draft before they are fed anyway


@dataclass
class _HeadSeq:
    fed: int  # head positions [0, fed) hold KV from the target's features
    # features of positions [fed, fed + sum of rows), in order: views of the steps' copies
    pending: list[torch.Tensor] = field(default_factory=list)
    last_fed: torch.Tensor | None = None  # the feature of position fed - 1 (the loop feeds it again)

    @property
    def end(self) -> int:
        return self.fed + sum(p.shape[0] for p in self.pending)

    def cut(self, end: int) -> None:
        """Keeps the features of positions before `end`."""
        kept, start = [], self.fed
        for p in self.pending:
            if start >= end:
                break
            kept.append(p[: end - start])
            start += p.shape[0]
        self.pending = kept

    def take(self, count: int) -> list[torch.Tensor]:
        """The first `count` pending rows (they are fed: `fed` moves past them)."""
        taken, left = [], count
        while left > 0:
            p = self.pending[0]
            taken.append(p[:left])
            if p.shape[0] > left:
                self.pending[0] = p[left:]
            else:
                self.pending.pop(0)
            left -= taken[-1].shape[0]
        self.fed += count
        if taken:
            self.last_fed = taken[-1][-1:]
        return taken


class _Feed(NamedTuple):
    """Positions of one request to feed the head: [seq.fed, up_to)."""

    seq: _HeadSeq
    token_ids: Sequence[int]  # the request's (x_{j+1} feeds position j)
    block_ids: Sequence[int]  # the target's, covering every position fed
    up_to: int


@dataclass
class _Row:
    request: DraftRequest
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


@register_proposer
class EagleProposer:
    name: ClassVar[str] = "eagle"

    def __init__(self, context: ProposerContext) -> None:
        self.context = context
        target = context.target_model
        if target is None or target.tp is not None:
            raise ValueError("speculative method 'eagle' needs the target model on one GPU; with "
                             "tensor_parallel_size > 1 use method='draft'")
        self.max_rows = max(context.max_num_batched_tokens, 128)  # NOTE: >= the warm-up's largest forward
        self.head: EagleHead = load_eagle_head(draft_dir(context.config), target, context.dtype, context.device,
                                               context.model.load_format, context.model.seed, self.max_rows)
        self.head.use_fused_ops(context.model.fused_ops and context.device.type == "cuda")
        arch = self.head.arch
        spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, None)
        self.backend = create_backend(context.model.attention_backend, spec, context.device)
        self.kv_bytes_per_block = bytes_per_block(arch, context.block_size, context.dtype)
        self.seqs: dict[str, _HeadSeq] = {}
        self.runner: ModelRunner | None = None
        self.loop: DraftLoopGraphs | None = None  # all K passes in one graph (CUDA), set by bind
        self.scratch_base = self.scratch_per_row = 0
        self._unread: list[DeviceDrafts] = []
        self.num_resets = 0  # requests whose features did not continue (their head KV may be stale)

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        ctx = self.context
        bs, k = ctx.block_size, ctx.config.num_draft_tokens
        self.scratch_base, self.scratch_per_row = num_target_blocks, -(-k // bs) + 1
        num_blocks = num_target_blocks + ctx.max_num_seqs * self.scratch_per_row
        kv = allocate_kv_tensors(self.head.arch, num_blocks, bs, ctx.dtype, ctx.device)
        self.runner = ModelRunner(self.head, kv, self.backend, ctx.device)  # type: ignore[arg-type]
        warm_up_runner(self.runner, max_seq_tokens + k)
        if ctx.cuda_graph_max_rows is not None and cuda_graphs_enabled(ctx.model, ctx.device, self.backend):
            self.runner.capture_decode_graphs(ctx.cuda_graph_max_rows, max_seq_tokens + k)
            limit = ctx.config.disable_above_batch_size
            max_batch = max(1, min(ctx.max_num_seqs, limit if limit is not None else ctx.max_num_seqs))
            head: Any = self.head  # NOTE: the loop runs it as it runs a model (same forward and logits)
            self.loop = DraftLoopGraphs(head, kv, self.backend, self.runner.staging, k, max_batch, max_seq_tokens + k)
            self.loop.capture()

    @property
    def kv_caches(self) -> torch.Tensor:
        assert self.runner is not None, "bind() first"
        return self.runner.kv_caches

    # ---- features
    @torch.inference_mode()
    def observe(self, scheduled: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
        """The target's step: its hidden states [tokens, hidden] of every position it computed, in
        scheduled order (a view that the next step overwrites: copied here)."""
        kept = hidden.clone()
        row = 0
        feed: list[_Feed] = []
        for s in scheduled:
            r, n = s.request, s.num_new_tokens
            start = r.num_computed_tokens
            seq = self.seqs.get(r.request_id)
            if seq is None or not seq.fed <= start <= seq.end:
                # NOTE: a new request trusts the head KV of the blocks it found cached
                self.num_resets += seq is not None
                seq = self.seqs[r.request_id] = _HeadSeq(start)
            seq.cut(start)
            seq.pending.append(kept[row : row + n])
            row += n
            # Positions whose next token the host has read (an asynchronous step's token is a placeholder
            # until then: engine/engine.py PLACEHOLDER, negative).
            known = min(seq.end, r.num_tokens - 1)
            while known > seq.fed and r.token_ids[known] < 0:
                known -= 1
            if known > seq.fed and (n > s.num_spec_tokens + 1 or seq.end - seq.fed > MAX_PENDING):
                feed.append(_Feed(seq, r.token_ids, r.block_ids, known))
        self._feed(feed)

    def _feed(self, feed: list[_Feed]) -> None:
        """Writes the head's KV of positions [fed, up_to) of each, from their pending features, in
        forwards of at most max_rows tokens."""
        assert self.runner is not None
        while feed:
            batch, rows = [], []
            budget = self.max_rows
            for f in feed:
                count = min(f.up_to - f.seq.fed, budget)
                if count <= 0:
                    break
                fed = f.seq.fed
                batch.append(ForwardSeq(f.token_ids[fed + 1 : fed + 1 + count], fed, f.block_ids, 0))
                rows.extend(f.seq.take(count))
                budget -= count
            torch.cat(rows, out=self.head.features[: self.max_rows - budget])
            self.runner.forward_hidden(batch)
            feed = [f for f in feed if f.seq.fed < f.up_to]

    # ---- drafting
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        assert self.runner is not None, "bind() first"
        self._read_pending()
        ready = []
        for r in requests:
            seq = self.seqs.get(r.request_id)
            n = len(r.token_ids) - 1
            if seq is not None and seq.fed < n <= seq.end:
                ready.append(r)
        if not ready:
            return [None] * len(requests)
        looped = self._loop(ready, generator)
        if looped is not None:
            return [looped.get(r.request_id) for r in requests]
        # Pass 1 feeds every row's pending positions up to its last token, in one forward when they fit.
        total = sum(len(r.token_ids) - 1 - self.seqs[r.request_id].fed for r in ready)
        if total > self.max_rows:
            self._feed([_Feed(self.seqs[r.request_id], r.token_ids, r.block_ids, len(r.token_ids) - 2) for r in ready])
        jobs = [_Row(r) for r in ready]
        tables = [self._table(r, i) for i, r in enumerate(ready)]
        fwd, features = [], []
        for r, table in zip(ready, tables):
            seq = self.seqs[r.request_id]
            n = len(r.token_ids) - 1
            fwd.append(ForwardSeq(r.token_ids[seq.fed + 1 :], seq.fed, table, 1))
            features.extend(seq.take(n - seq.fed))
        on_device = not any(has_penalty(r.params) for r in ready)
        torch.cat(features, out=self.head.features[: sum(len(f.token_ids) for f in fwd)])
        f = self.runner.forward_hidden(fwd)
        passes = [(draw_drafts(self.context.sampler, jobs, self.head.compute_logits(f), generator, on_device), jobs)]
        active = jobs
        table_of = {id(j): t for j, t in zip(jobs, tables)}
        for i in range(1, max(r.max_draft_tokens for r in ready)):
            previous = active
            where = {id(j): row for row, j in enumerate(previous)}
            active = [j for j in previous if j.request.max_draft_tokens > i]
            rows = [where[id(j)] for j in active]
            # Pass i + 1 feeds d_i with the f that drew it (compute_logits left every row's in the
            # feature buffer), at the position after that f's.
            if len(active) < len(previous):
                self.head.features[: len(active)].copy_(f.index_select(0, upload(rows, torch.long, f.device)))
            if on_device:
                patch = TokenPatch(passes[-1][0], list(range(len(active))), rows)
                fwd = [ForwardSeq([0], len(j.request.token_ids) + i - 2, table_of[id(j)], 1) for j in active]
            else:
                patch = None
                fwd = [ForwardSeq([j.token_ids[-1]], len(j.request.token_ids) + i - 2, table_of[id(j)], 1)
                       for j in active]
            f = self.runner.forward_hidden(fwd, patch)
            logits = self.head.compute_logits(f)
            passes.append((draw_drafts(self.context.sampler, active, logits, generator, on_device), active))
        read = DeviceDrafts(jobs, passes) if on_device else None
        if read is not None:
            self._unread.append(read)
        drafts = {j.request.request_id: self._draft_of(j, read) for j in jobs}
        return [drafts.get(r.request_id) for r in requests]

    def _loop(self, ready: list[DraftRequest], generator: torch.Generator | None) -> dict[str, Draft] | None:
        """All K passes in the loop graph (engine/spec/draft_loop.py), when it serves every row: its
        first pass feeds each row's last two positions, n - 2 and n - 1 (x_{n-1}, x_n beside h_{n-2},
        h_{n-1}; n - 2 again when it was fed: the same inputs), after a forward of whatever waited
        before them; its later passes feed the head its own f (EagleHead.compute_logits leaves it in
        the feature buffer). None: not served, nothing done."""
        loop = self.loop
        if loop is None:
            return None
        k = loop.num_passes
        seqs = [self.seqs[r.request_id] for r in ready]
        num_outputs = [len(r.token_ids) - r.num_prompt_tokens for r in ready]
        if not loop.serves([r.params for r in ready], num_outputs, [r.max_draft_tokens for r in ready], k):
            return None
        for r, seq in zip(ready, seqs):
            n = len(r.token_ids) - 1
            if n < 2 or (seq.fed == n - 1 and seq.last_fed is None):
                return None
        self._feed([_Feed(seq, r.token_ids, r.block_ids, len(r.token_ids) - 3) for r, seq in zip(ready, seqs)
                    if seq.fed < len(r.token_ids) - 3])
        features, rows = [], []
        for i, (r, seq) in enumerate(zip(ready, seqs)):
            n = len(r.token_ids) - 1
            before = [seq.last_fed] if seq.fed == n - 1 else []
            features.extend(before + seq.take(n - seq.fed))
            temperature = 0.0 if r.params.is_greedy else r.params.temperature
            table = self._table(r, i, k)
            rows.append(LoopRow(n - 1, (r.token_ids[n - 1], r.token_ids[n]), table, temperature))
        torch.cat(features, out=self.head.features[: 2 * len(ready)])
        out = loop.run(rows, generator)
        assert out is not None, "served rows within the loop's context"
        tokens, dists = out
        jobs = [_Row(r, [DRAFT_PLACEHOLDER] * r.max_draft_tokens) for r in ready]
        read = DeviceDrafts(jobs, [(tokens[i], jobs) for i in range(k)])
        self._unread.append(read)
        kept = dists.clone() if any(not r.params.is_greedy for r in ready) else None  # the next run overwrites it
        drafts = {}
        for row, j in enumerate(jobs):
            r = j.request
            probs = None if r.params.is_greedy or kept is None else kept[: r.max_draft_tokens, row]
            where = DeviceTokens(read.tokens, read.index[id(j)][: r.max_draft_tokens])
            drafts[r.request_id] = Draft(j.token_ids, probs, where, read.read)
        return drafts

    def _table(self, r: DraftRequest, row: int, k: int | None = None) -> list[int]:
        """Block ids covering head positions [0, n + k - 1) (k: the request's drafts by default): the
        target's, then the row's scratch."""
        bs = self.context.block_size
        needed = -(-(len(r.token_ids) - 1 + (k or r.max_draft_tokens)) // bs)
        table = list(r.block_ids[:needed])
        scratch = self.scratch_base + row * self.scratch_per_row
        table.extend(range(scratch, scratch + needed - len(table)))
        assert needed - len(r.block_ids[:needed]) <= self.scratch_per_row, "the target holds the prompt's blocks"
        return table

    def _draft_of(self, j: _Row, read: DeviceDrafts | None) -> Draft:
        r = j.request
        probs = None if r.params.is_greedy else torch.stack(j.probs[: r.max_draft_tokens])
        if read is None:
            return Draft(j.token_ids, probs)
        return Draft(j.token_ids, probs, DeviceTokens(read.tokens, read.index[id(j)]), read.read)

    def _read_pending(self) -> None:
        for pending in self._unread:
            pending.read()
        self._unread.clear()

    def chain(self, request_ids: Sequence[str], verified: torch.Tensor, generator: torch.Generator | None) -> bool:
        return False  # NOTE: not yet: each proposal waits for the host to read the verification

    def skip(self) -> None:
        """Nothing is queued ahead (no chaining)."""

    def drop(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        self._read_pending()
        stale = sorted(set(self.seqs) - set(live_request_ids))
        if stale:
            raise IntegrityError(f"the EAGLE head holds features of requests no longer running: {stale[:8]}")
