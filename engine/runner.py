"""ModelRunner: a scheduled batch -> flat tensors -> forward -> logits of the sampling rows.

Owns the model, the KV tensors and the attention backend of one device. Knows nothing of
queues, budgets or sampling parameters.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models import LlamaForCausalLM
from engine.scheduler import ScheduledRequest


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

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata, and the rows whose logits are sampled."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for s in scheduled:
            r = s.request
            start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.token_ids[start:stop])
            positions.extend(range(start, stop))
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in range(start, stop))
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(stop)
            block_tables.append(r.block_ids)
            if s.will_sample:
                sample_rows.append(query_start_loc[-1] - 1)
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
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, sample_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Runs one step; returns float32 logits [num_sampling_requests, vocab], in scheduled order."""
        ids, pos, meta, sample_rows = self.prepare(scheduled)
        hidden = self.model(ids, pos, self.kv_caches, meta, self.backend)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
