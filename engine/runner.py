"""ModelRunner: a scheduled batch -> flat tensors -> forward -> logits of the sampling rows.

Owns the model, the KV tensors and the attention backend of one device. Knows nothing of
queues, budgets or sampling parameters. `execute` serves the engine's scheduled batches; `forward`
takes plain `ForwardSeq`s, so a second model (the speculative draft) runs through the same code
over a cache of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models import LlamaForCausalLM
from engine.scheduler import ScheduledRequest


@dataclass(frozen=True)
class ForwardSeq:
    """One sequence's part of a forward pass."""

    token_ids: Sequence[int]  # the inputs at positions [start, start + len(token_ids))
    start: int  # positions before it already have KV in block_ids
    block_ids: Sequence[int]  # covering positions [0, start + len(token_ids))
    num_logits: int  # logits of the last num_logits positions are returned (0: none)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = device
        self.block_size = kv_caches.shape[3]

    def prepare(self, seqs: Sequence[ForwardSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
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
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_tables_tensor=torch.tensor(padded, dtype=torch.int32, device=dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            max_query_len=max(len(s.token_ids) for s in seqs),
            max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, logit_rows

    @torch.inference_mode()
    def forward(self, seqs: Sequence[ForwardSeq]) -> torch.Tensor:
        """Writes the sequences' new KV; returns float32 logits [sum of num_logits, vocab], in order."""
        ids, pos, meta, logit_rows = self.prepare(seqs)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Runs one step; returns float32 logits [rows, vocab] in scheduled order: one row per
        sampling request, 1 + num_spec_tokens rows per verifying one (its last computed token's,
        then each drafted token's)."""
        return self.forward([_forward_seq(s) for s in scheduled])


def _forward_seq(s: ScheduledRequest) -> ForwardSeq:
    r = s.request
    start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
    if s.num_spec_tokens:
        assert r.draft is not None and stop - s.num_spec_tokens == r.num_tokens, "drafts follow the last token"
        token_ids = r.token_ids[start:] + r.draft.token_ids[: s.num_spec_tokens]
    else:
        token_ids = r.token_ids[start:stop]
    num_logits = 1 + s.num_spec_tokens if s.will_sample else 0
    return ForwardSeq(token_ids, start, r.block_ids, num_logits)
