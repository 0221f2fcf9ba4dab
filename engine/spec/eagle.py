"""The EAGLE proposer: an EAGLE-1 head (engine/spec/eagle_head.py) drafts from the target's own
hidden states, one decoder layer a drafted token instead of a whole draft model.

Features. The target's runner hands every step's hidden states and their cache slots to `observe`
(ModelRunner.observer), which writes them into a feature cache paged like the KV cache (slot s of
the target's cache holds the feature of the position stored there): one copy a step, whatever the
batch. Head position j needs h_j and the token x_{j+1}, so it is fed once that token is known: a
step that computes prompt tokens feeds all of its chunk but the prompt's last position at once;
decoding positions are fed when the request next drafts. Per request the proposer keeps only `fed`
(head positions [0, fed) hold KV from the target's features).

KV. The head's cache has one layer and is indexed by the target's block ids, as the features are:
head position j lives in the target's block of position j, so blocks that prefix caching shares
carry the head's KV and features of the request that computed them, and the target's pool frees
them. Drafting writes up to K - 1 positions past the request's last token, where the target may hold
no block yet: those land in scratch blocks after the target's, a fixed group per row of the
proposal (their KV is read within the proposal only; the next proposal feeds those positions again
from the target's features). NOTE: a shared block's head KV at a position whose next token differs
between the requests sharing it (the last position of one's prompt, the next prompt token of the
other's) is the first request's: drafts after it may be accepted less often, output stays exact.

Drafting (`propose`): on CUDA, all K passes replay in the draft model's loop graph
(engine/spec/draft_loop.py, run with the head as its model): after a forward of any positions that
waited before the last two, its first pass feeds positions n - 2 and n - 1 (x_{n-1}, x_n beside
h_{n-2}, h_{n-1}; n - 2 again, from the same inputs, when it was fed already) and draws d_1; pass i
feeds d_{i-1} with the f before it (EagleHead.compute_logits leaves f in the feature buffer) and
draws d_i. Rows the loop does not serve (penalties, seeds, truncation) draft pass by pass: pass 1
feeds the positions [fed, n - 1], each later pass one position, through the head runner's
decode graphs, with the Sampler's draws. Drafts stay on the device until first read, as the draft
model's do.

Not here yet: chaining (`chain` queues nothing), tensor-parallel targets, and disaggregated
workers (the head's KV of a pushed prompt is not pushed).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
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


def _slots(block_ids: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The cache slots of a request's positions (the target's, and the feature cache's)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


class _Feed(NamedTuple):
    """Positions [fed, up_to) of one request to feed the head."""

    request_id: str
    token_ids: Sequence[int]  # the request's (x_{j+1} feeds position j)
    block_ids: Sequence[int]  # the target's, covering every position fed
    fed: int
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
        # The head's KV and the target's features, per target block.
        element = torch.empty((), dtype=context.dtype).element_size()
        feature_bytes = context.block_size * arch.hidden_size * element  # NOTE: the head's is the target's
        self.kv_bytes_per_block = bytes_per_block(arch, context.block_size, context.dtype) + feature_bytes
        self.fed: dict[str, int] = {}  # per request: head positions [0, fed) hold KV from the target's features
        self.features = torch.empty(0)  # [target slots, hidden]: the feature of the position each slot holds
        self.runner: ModelRunner | None = None
        self.loop: DraftLoopGraphs | None = None  # all K passes in one graph (CUDA), set by bind
        self.scratch_base = self.scratch_per_row = 0
        self._unread: list[DeviceDrafts] = []

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        ctx = self.context
        bs, k = ctx.block_size, ctx.config.num_draft_tokens
        self.scratch_base, self.scratch_per_row = num_target_blocks, -(-k // bs) + 1
        num_blocks = num_target_blocks + ctx.max_num_seqs * self.scratch_per_row
        kv = allocate_kv_tensors(self.head.arch, num_blocks, bs, ctx.dtype, ctx.device)
        self.features = torch.zeros(num_target_blocks * bs, self.head.arch.hidden_size, dtype=ctx.dtype,
                                    device=ctx.device)
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
    def observe(self, scheduled: Sequence[ScheduledRequest], hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """The target's step: the hidden states [tokens, hidden] of every position it computed, in
        scheduled order, and the cache slots [tokens] of those positions (device tensors)."""
        self.features.index_copy_(0, slots, hidden)
        feed: list[_Feed] = []
        for s in scheduled:
            r = s.request
            start = r.num_computed_tokens
            fed = self.fed.get(r.request_id)
            if fed is None or fed > start:
                # NOTE: a new request trusts the head KV of the blocks it found cached
                fed = self.fed[r.request_id] = start
            if s.num_new_tokens > s.num_spec_tokens + 1:  # prompt tokens: their next tokens are known
                # NOTE: never up to an asynchronous step's token, a placeholder until read (engine/engine.py)
                known = min(start + s.num_new_tokens, r.num_tokens - 1)
                while known > fed and r.token_ids[known] < 0:
                    known -= 1
                if known > fed:
                    feed.append(_Feed(r.request_id, r.token_ids, r.block_ids, fed, known))
        self._feed(feed)

    def _feed(self, feed: Sequence[_Feed]) -> None:
        """Writes the head's KV of positions [fed, up_to) of each request, from the target's features,
        in forwards of at most max_rows tokens; moves each request's `fed` to up_to."""
        assert self.runner is not None
        bs = self.context.block_size
        todo = [f for f in feed if f.up_to > f.fed]
        while todo:
            batch, positions, left = [], [], []
            budget = self.max_rows
            for f in todo:
                count = min(f.up_to - f.fed, budget)
                if count <= 0:
                    left.append(f)
                    continue
                batch.append(ForwardSeq(f.token_ids[f.fed + 1 : f.fed + 1 + count], f.fed, f.block_ids, 0))
                positions.extend(_slots(f.block_ids, range(f.fed, f.fed + count), bs))
                if f.fed + count < f.up_to:
                    left.append(f._replace(fed=f.fed + count))
                budget -= count
            self._gather_features(positions)
            self.runner.forward_hidden(batch)
            todo = left
        for f in feed:
            self.fed[f.request_id] = max(self.fed[f.request_id], f.up_to)

    def _gather_features(self, slots: list[int]) -> None:
        """The head's feature buffer rows [0, len(slots)) <- the target's features at these slots."""
        index = upload(slots, torch.long, self.features.device)
        torch.index_select(self.features, 0, index, out=self.head.features[: len(slots)])

    # ---- drafting
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        assert self.runner is not None, "bind() first"
        self._read_pending()
        # Requests whose features reach their last token's position n - 1 (the target computed it).
        ready = [r for r in requests if r.request_id in self.fed and self.fed[r.request_id] < len(r.token_ids) - 1]
        if not ready:
            return [None] * len(requests)
        looped = self._loop(ready, generator)
        if looped is not None:
            return [looped.get(r.request_id) for r in requests]
        # Pass 1 feeds every row's positions [fed, n - 1], in one forward when they fit.
        if sum(len(r.token_ids) - 1 - self.fed[r.request_id] for r in ready) > self.max_rows:
            self._feed([_Feed(r.request_id, r.token_ids, r.block_ids, self.fed[r.request_id], len(r.token_ids) - 2)
                        for r in ready])
        jobs = [_Row(r) for r in ready]
        tables = [self._table(r, i) for i, r in enumerate(ready)]
        bs = self.context.block_size
        fwd, slots = [], []
        for r, table in zip(ready, tables):
            fed, n = self.fed[r.request_id], len(r.token_ids) - 1
            fwd.append(ForwardSeq(r.token_ids[fed + 1 :], fed, table, 1))
            slots.extend(_slots(r.block_ids, range(fed, n), bs))
            self.fed[r.request_id] = n
        on_device = not any(has_penalty(r.params) for r in ready)
        self._gather_features(slots)
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
        if loop is None or any(len(r.token_ids) < 3 for r in ready):  # NOTE: n >= 2 (a position n - 2)
            return None
        k = loop.num_passes
        num_outputs = [len(r.token_ids) - r.num_prompt_tokens for r in ready]
        if not loop.serves([r.params for r in ready], num_outputs, [r.max_draft_tokens for r in ready], k):
            return None
        self._feed([_Feed(r.request_id, r.token_ids, r.block_ids, self.fed[r.request_id], len(r.token_ids) - 3)
                    for r in ready])
        bs = self.context.block_size
        slots, rows = [], []
        for i, r in enumerate(ready):
            n = len(r.token_ids) - 1
            slots.extend(_slots(r.block_ids, (n - 2, n - 1), bs))
            temperature = 0.0 if r.params.is_greedy else r.params.temperature
            rows.append(LoopRow(n - 1, (r.token_ids[n - 1], r.token_ids[n]), self._table(r, i, k), temperature))
            self.fed[r.request_id] = n
        self._gather_features(slots)
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
        self.fed.pop(request_id, None)

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        self._read_pending()
        stale = sorted(set(self.fed) - set(live_request_ids))
        if stale:
            raise IntegrityError(f"the EAGLE head holds features of requests no longer running: {stale[:8]}")
