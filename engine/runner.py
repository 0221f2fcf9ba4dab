"""ModelRunner: a scheduled batch -> flat tensors -> forward -> logits of the sampling rows.

Owns the model, the KV tensors and the attention backend of one device. Knows nothing of
queues, budgets or sampling parameters. `execute` serves the engine's scheduled batches; `forward`
takes plain `ForwardSeq`s, so a second model (the speculative draft) runs through the same code
over a cache of its own.

A step's integer inputs (token ids, positions, slots, context lengths, block tables, logit rows)
are written into one host buffer (pinned on CUDA) and reach the device in one non_blocking copy;
nothing in a forward reads a device value back. Steps that fit the captured graphs (decode steps,
verifications, short prompts: engine/cuda_graphs.py) replay CUDA graphs once
`capture_decode_graphs` has run; every other step runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.models import LlamaForCausalLM
from engine.parallel import TPGroup
from engine.pinned import HostStaging, upload
from engine.scheduler import ScheduledRequest

class ForwardSeq(NamedTuple):  # NOTE: a NamedTuple, not a frozen dataclass: one is built per request a step
    """One sequence's part of a forward pass."""

    token_ids: Sequence[int]  # the inputs at positions [start, start + len(token_ids))
    start: int  # positions before it already have KV in block_ids
    block_ids: Sequence[int]  # covering positions [0, start + len(token_ids))
    num_logits: int  # logits of the last num_logits positions are returned (0: none)


class TokenPatch:
    """Input tokens that are still on the device (asynchronous scheduling): flat input positions
    `dst` of a step take `tokens[src]`, a tensor the previous step's sampler wrote and the host has
    not read. The host writes a placeholder there; `apply` overwrites it on the device, queued
    after the sampler and before the forward, so nothing waits."""

    def __init__(self, tokens: torch.Tensor, dst: list[int], src: list[int]) -> None:
        self.tokens, self.dst, self.src = tokens, dst, src

    def apply(self, ids: torch.Tensor) -> None:
        """ids: [num_tokens] int64 on the device, in place."""
        n = len(self.dst)
        index = upload(self.dst + self.src, torch.long, ids.device)
        ids.index_copy_(0, index[:n], self.tokens.index_select(0, index[n:]))


class ForwardStep(NamedTuple):
    """Rank 0's hand-off of one forward to the other ranks of a tensor-parallel worker: the step's
    sequences. Inputs still on rank 0's device (a TokenPatch) are not sent: only rank 0 reads token ids
    (llama.LlamaForCausalLM.embed), so the other ranks run the sequences with whatever ids they hold."""

    seqs: Sequence[ForwardSeq]


class StepLeader:
    """Rank 0's side of the hand-off: every forward is first broadcast to the other ranks, which
    run the same forward (engine/parallel/follower.py), so their collectives meet rank 0's."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def hand_off(self, seqs: Sequence[ForwardSeq]) -> None:
        self.group.broadcast_object(ForwardStep(list(seqs)))

    def send(self, message: object) -> None:
        """Another message for the followers, in order with the forwards (e.g. Stop)."""
        self.group.broadcast_object(message)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        device: torch.device,
        leader: StepLeader | None = None,
    ) -> None:
        """leader: rank 0 of a tensor-parallel worker hands each forward to the other ranks."""
        self.model = model
        self.leader = leader
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = device
        self.block_size = kv_caches.shape[3]
        self.staging = HostStaging(device)
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs

    def capture_decode_graphs(self, max_rows: int, max_context: int) -> None:
        """Captures CUDA graphs of steps of up to max_rows one-query rows (engine/cuda_graphs.py)
        whose contexts are at most max_context tokens; call once, after the KV cache exists, before
        any step."""
        assert self.graphs is None, "graphs are captured once"
        graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.staging, max_rows, max_context)
        graphs.capture()
        self.graphs = graphs

    def release_graphs(self) -> None:
        """No graph steps after this (a tensor-parallel rank's, before its group shuts down)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def prepare(
        self, seqs: Sequence[ForwardSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat input ids, positions, attention metadata, and the rows whose logits are returned."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        logit_rows: list[int] = []
        bs = self.block_size
        for s in seqs:
            start, stop = s.start, s.start + len(s.token_ids)
            input_ids.extend(s.token_ids)
            positions.extend(range(start, stop))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, stop))
            query_start_loc.append(query_start_loc[-1] + len(s.token_ids))
            seq_lens.append(stop)
            block_tables.append(list(s.block_ids))
            logit_rows.extend(range(query_start_loc[-1] - s.num_logits, query_start_loc[-1]))
        num_seqs, max_blocks = len(seqs), max(len(t) for t in block_tables)
        # One int64 upload: these parts, each from a 16-value boundary, then the block tables
        # [num_seqs, max_blocks] padded with block 0.
        parts: list[list[int]] = [input_ids, positions, slots, logit_rows, seq_lens, query_start_loc]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + _align16(len(part)))
        table_offset = offsets[-1]
        num_values = table_offset + num_seqs * max_blocks
        host = self.staging.host(num_values)
        for part, offset in zip(parts, offsets):
            host[offset : offset + len(part)] = part
        host_tables = host[table_offset:].reshape(num_seqs, max_blocks)
        host_tables.fill(0)
        for i, t in enumerate(block_tables):
            host_tables[i, : len(t)] = t
        flat = self.staging.upload(num_values)
        ids, pos, slot_mapping, rows, lens, starts = (
            flat[offset : offset + len(part)] for part, offset in zip(parts, offsets)
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_tables_tensor=flat[table_offset:].view(num_seqs, max_blocks).to(torch.int32),
            seq_lens_tensor=lens.to(torch.int32),
            query_start_loc_tensor=starts.to(torch.int32),
            max_query_len=max(len(s.token_ids) for s in seqs),
            max_seq_len=max(seq_lens),
        )
        return ids, pos, meta, rows

    @torch.inference_mode()
    def forward(
        self, seqs: Sequence[ForwardSeq], patch: TokenPatch | None = None
    ) -> torch.Tensor:
        """Writes the sequences' new KV; returns float32 logits [sum of num_logits, vocab], in order.
        `patch`: input tokens to take from the device (see TokenPatch)."""
        if self.leader is not None:
            self.leader.hand_off(seqs)
        if self.graphs is not None:
            hidden = self.graphs.run(seqs, patch)  # None: not a step a graph serves
            if hidden is not None:
                return self.model.compute_logits(hidden)
        return self.forward_eager(seqs, patch)

    @torch.inference_mode()
    def forward_eager(self, seqs: Sequence[ForwardSeq], patch: TokenPatch | None = None) -> torch.Tensor:
        """`forward` on this rank alone, without graphs (the other ranks of a tensor-parallel worker
        must run the same forward: the engine's warm-up runs it on every rank)."""
        ids, pos, meta, logit_rows = self.prepare(seqs)
        if patch is not None:
            patch.apply(ids)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden.index_select(0, logit_rows))

    def execute(
        self, scheduled: Sequence[ScheduledRequest], patch: TokenPatch | None = None
    ) -> torch.Tensor:
        """Runs one step; returns float32 logits [rows, vocab] in scheduled order: one row per
        sampling request, 1 + num_spec_tokens rows per verifying one (its last computed token's,
        then each drafted token's)."""
        seqs, drafts = _forward_seqs(scheduled, patch_drafts=patch is None)
        return self.forward(seqs, patch or drafts)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def _forward_seqs(
    scheduled: Sequence[ScheduledRequest], patch_drafts: bool
) -> tuple[list[ForwardSeq], TokenPatch | None]:
    """The step's sequences, and (patch_drafts) its drafted inputs still on the device as a patch of
    its flat inputs, which get placeholders there. One patch takes one tensor: a draft proposed in
    another step than the first such draft's is read here (a draft outlives its step only when its
    request was not scheduled); with patch_drafts False (another patch) every draft is read."""
    seqs: list[ForwardSeq] = []
    tokens: torch.Tensor | None = None
    dst: list[int] = []
    src: list[int] = []
    position = 0  # the flat input position of the sequence's first token
    for s in scheduled:
        r, k = s.request, s.num_spec_tokens
        start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        if k:
            draft = r.draft
            assert draft is not None and stop - k == r.num_tokens, "drafts follow the last token"
            where = draft.on_device if patch_drafts and not draft.is_read else None
            if where is not None and tokens is None:
                tokens = where.tokens
            if where is not None and where.tokens is tokens:
                dst.extend(range(position + s.num_new_tokens - k, position + s.num_new_tokens))
                src.extend(where.index[:k])
                drafted = [0] * k  # NOTE: placeholders: the patch writes the drafts there on the device
            else:
                drafted = draft.token_ids[:k]  # read (waits for the draft model) if it was not
            token_ids = r.token_ids[start:] + drafted
        else:
            token_ids = r.token_ids[start:stop]
        seqs.append(ForwardSeq(token_ids, start, r.block_ids, 1 + k if s.will_sample else 0))
        position += s.num_new_tokens
    return seqs, TokenPatch(tokens, dst, src) if tokens is not None else None
