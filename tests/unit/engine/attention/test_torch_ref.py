"""The torch reference attention against a naive dense computation: paged gather, causal mask
with a cached prefix, sliding window, GQA, chunked queries; and the fused causal path."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_ref import _causal_sdpa, attend, gather_context


def _dense(q, k, v, scale, window=None):  # q [n, H, D]; k, v [ctx, KVH, D]
    n, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1).double()
    v = v.repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(ctx - n, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos > qpos
    if window is not None:
        mask |= kpos <= qpos - window
    scores.masked_fill_(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("n", "ctx", "heads", "kv_heads", "window", "max_scores"),
    [(1, 1, 4, 4, None, 1 << 20), (1, 37, 8, 2, None, 1 << 20), (29, 29, 4, 1, None, 64),
     (13, 50, 6, 3, None, 100), (40, 40, 4, 2, 7, 1 << 20), (5, 33, 4, 2, 16, 50)],
)
def test_attend_matches_dense(n, ctx, heads, kv_heads, window, max_scores):
    g = torch.Generator().manual_seed(n * 1000 + ctx)
    q = torch.randn(n, heads, 16, generator=g)
    k = torch.randn(ctx, kv_heads, 16, generator=g)
    v = torch.randn(ctx, kv_heads, 16, generator=g)
    got = attend(q, k, v, 0.25, window, max_scores)
    torch.testing.assert_close(got.double(), _dense(q, k, v, 0.25, window), atol=1e-5, rtol=1e-5)


def test_gather_context_follows_block_table():
    cache = torch.arange(6 * 4 * 2 * 3, dtype=torch.float32).view(6, 4, 2, 3)  # [blocks, block, heads, dim]
    got = gather_context(cache, [5, 0, 3], 10)
    want = torch.cat([cache[5], cache[0], cache[3]])[:10]
    assert torch.equal(got, want)


def test_fused_causal_path_matches_reference():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(45, 8, 32, generator=g), torch.randn(45, 2, 32, generator=g),
               torch.randn(45, 2, 32, generator=g))
    torch.testing.assert_close(_causal_sdpa(q, k, v, 0.2), attend(q, k, v, 0.2, None, 1 << 20), atol=1e-5, rtol=1e-5)
