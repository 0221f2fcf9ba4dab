"""The reference attention backend: plain torch over the paged KV cache, on any device.

Correct first, not fast: one sequence at a time, queries in chunks so that no score matrix is
larger than `max_scores` elements (never [T, T] for a long prompt). The Triton backend is checked
against this one.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, AttentionSpec, register_backend, write_kv


def gather_context(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence from a paged cache -> [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    ids = torch.tensor(block_table[:num_blocks], device=cache.device, dtype=torch.long)
    if cache.element_size() == 1:  # NOTE: FP8 as raw bytes: torch's CPU index_select has no float8 kernel
        return cache.view(torch.uint8).index_select(0, ids).view(cache.dtype).flatten(0, 1)[:seq_len]
    return cache.index_select(0, ids).flatten(0, 1)[:seq_len]


def attend(
    q: torch.Tensor,  # [n, heads, dim], positions [ctx - n, ctx)
    k: torch.Tensor,  # [ctx, kv_heads, dim]
    v: torch.Tensor,  # [ctx, kv_heads, dim]
    scale: float,
    sliding_window: int | None,
    max_scores: int,
) -> torch.Tensor:  # [n, heads, dim]
    n, num_heads, head_dim = q.shape
    ctx, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    kf = k.float().permute(1, 0, 2)  # [kv_heads, ctx, dim]
    vf = v.float().permute(1, 0, 2)
    key_pos = torch.arange(ctx, device=q.device)
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    chunk = max(1, max_scores // max(1, ctx * num_heads))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        qc = q[start:stop].float().view(stop - start, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(qc, kf.unsqueeze(1).transpose(-1, -2)) * scale  # [kv_heads, group, c, ctx]
        query_pos = torch.arange(ctx - n + start, ctx - n + stop, device=q.device)
        masked = key_pos[None, :] > query_pos[:, None]  # [c, ctx]
        if sliding_window is not None:
            masked |= key_pos[None, :] <= query_pos[:, None] - sliding_window
        scores.masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        oc = torch.matmul(probs, vf.unsqueeze(1))  # [kv_heads, group, c, dim]
        out[start:stop] = oc.permute(2, 0, 1, 3).reshape(stop - start, num_heads, head_dim).to(q.dtype)
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, heads, dim], k/v: [n, kv_heads, dim] -> [n, heads, dim], causal, grouped-query."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


@register_backend
class TorchAttention:
    name: ClassVar[str] = "torch"
    supports_cpu: ClassVar[bool] = True
    supports_cuda: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = False  # host lists and a per-sequence loop
    takes_stored_kv: ClassVar[bool] = False  # a whole prompt's attention reads the new K/V, not the cache

    def __init__(self, spec: AttentionSpec, max_scores: int = 1 << 22) -> None:
        self.spec = spec
        self.max_scores = max_scores

    def crowded_decode_seqs(self, device: torch.device) -> int | None:
        return None  # no tiles

    def crowded_prefill_tokens(self, device: torch.device) -> int | None:
        return None

    def rotates(self, meta: AttentionMetadata) -> bool:
        return False  # the model rotates and passes the new K/V (no forward_rotated)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        exact_cache = k_cache.dtype == k.dtype
        out = torch.empty_like(q)
        for i, seq_len in enumerate(meta.seq_lens):
            start, stop = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            if stop - start == seq_len > 1 and self.spec.sliding_window is None and q.is_cuda and exact_cache:
                # A whole prompt with no cached prefix: its K/V are the new ones (as the cache holds
                # them, unless the cache rounds them: FP8); let torch's fused causal kernel (flash
                # attention on GPUs) do it without a score matrix.
                out[start:stop] = _causal_sdpa(q[start:stop], k[start:stop], v[start:stop], self.spec.scale)
                continue
            ks = gather_context(k_cache, meta.block_tables[i], seq_len)
            vs = gather_context(v_cache, meta.block_tables[i], seq_len)
            out[start:stop] = attend(
                q[start:stop], ks, vs, self.spec.scale, self.spec.sliding_window, self.max_scores
            )
        return out
