"""What a speculative step's pieces cost on the device at batch 1, each captured in a CUDA graph:
a plain target step, a verification of K+1 rows, K passes of a draft model, K passes of an
EAGLE-style head (bench/eagle_head.py). Lab only.

Every model runs the same plain torch ops over dense KV caches (attention by SDPA, a draw by the
Gumbel-max trick), so the pieces compare with one another; the engine's fused kernels make every
piece cheaper, so the levels are not the engine's (bench.spec_decode measures those).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import graph_seconds
from bench.eagle_head import EagleHead
from bench.train_llama import RMS_NORM_EPS, DecoderLayer, ModelShape, TrainLlama


class DenseCache:
    """K and V of `layers` layers for one sequence of up to `max_len` positions."""

    def __init__(self, shape: ModelShape, layers: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        size = (layers, 1, shape.num_kv_heads, max_len, shape.head_dim)
        self.k = torch.randn(size, device=device, dtype=dtype)  # NOTE: random, not zeros: a context to read
        self.v = torch.randn(size, device=device, dtype=dtype)


def layer_rows(layer: DecoderLayer, shape: ModelShape, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, input_norm: bool = True) -> torch.Tensor:
    """One decoder layer over new rows x [1, n, hidden] at positions start .. start + n - 1: writes
    their K and V into the caches [1, kv_heads, max_len, head_dim], attends over all before them.
    input_norm False: an EAGLE-1 head's layer, which has none."""
    n = x.shape[1]
    attn = layer.self_attn
    h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, RMS_NORM_EPS) if input_norm else x
    q, k, v = attn.project(h, cos, sin)
    k_cache[:, :, start : start + n] = k
    v_cache[:, :, start : start + n] = v
    end = start + n
    mask = torch.ones(n, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask, enable_gqa=True)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(1, n, shape.num_heads * shape.head_dim))
    h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, RMS_NORM_EPS)
    return x + layer.mlp(h)


def gumbel_draw(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: a draw at temperature 1, by argmax of logits plus Gumbel noise."""
    noise = -torch.log(-torch.log(torch.rand_like(logits, dtype=torch.float32).clamp_(1e-20, 1.0)))
    return (logits.float() + noise).argmax(-1)


class Costs:
    """The pieces' graphs for a target, a draft model and a head, at one context length."""

    def __init__(self, target: TrainLlama, draft: TrainLlama, head: EagleHead, k: int, context: int) -> None:
        self.target, self.draft, self.head, self.k, self.context = target, draft, head, k, context
        device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
        max_len = context + k + 2
        self.caches = {
            "target": DenseCache(target.shape, target.shape.num_layers, max_len, device, dtype),
            "draft": DenseCache(draft.shape, draft.shape.num_layers, max_len, device, dtype),
            "head": DenseCache(head.shape, 1, max_len, device, dtype),
        }
        self.rope = target.rope(torch.arange(max_len, device=device), dtype)  # the three share head_dim and theta
        self.token = torch.ones(1, 1, dtype=torch.long, device=device)
        self.rows = torch.ones(1, k + 1, dtype=torch.long, device=device)
        self.feature = torch.randn(1, 1, target.shape.hidden_size, device=device, dtype=dtype)

    def _model_rows(self, model: TrainLlama, cache: DenseCache, tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = model.model.embed_tokens(tokens)
        n = tokens.shape[1]
        cos, sin = self.rope[0][start : start + n], self.rope[1][start : start + n]
        for i, layer in enumerate(model.model.layers):
            x = layer_rows(layer, model.shape, x, cos, sin, cache.k[i], cache.v[i], start)
        return x

    def plain_step(self) -> None:
        x = self._model_rows(self.target, self.caches["target"], self.token, self.context)
        self.token.copy_(gumbel_draw(self.target.logits(x)[0])[None])

    def verification(self) -> None:
        """K+1 rows scored; the distributions and the target's draws that the accept rule reads."""
        x = self._model_rows(self.target, self.caches["target"], self.rows, self.context)
        logits = self.target.logits(x)[0]
        probs = torch.softmax(logits.float(), dim=-1)
        kept = probs[:-1].gather(1, self.rows[0, 1:, None])
        self.rows[0, :1].copy_(gumbel_draw(logits[-1:]) + (kept.sum() > 0).long())

    def draft_loop(self) -> None:
        for i in range(self.k):
            x = self._model_rows(self.draft, self.caches["draft"], self.token, self.context + i)
            logits = self.draft.logits(x)[0]
            torch.softmax(logits.float(), dim=-1)  # q, kept for the accept rule
            self.token.copy_(gumbel_draw(logits)[None])

    def head_loop(self) -> None:
        head, cache = self.head, self.caches["head"]
        for i in range(self.k):
            start = self.context + i
            x = head.inputs(self.token, self.feature)
            f = layer_rows(head.layer, head.shape, x, self.rope[0][start : start + 1], self.rope[1][start : start + 1],
                           cache.k[0], cache.v[0], start, input_norm=False)
            logits = head.logits(f)[0]
            torch.softmax(logits.float(), dim=-1)
            self.token.copy_(gumbel_draw(logits)[None])
            self.feature.copy_(f)

    def measure(self, count: int) -> dict[str, float]:
        """Seconds of each piece: `count` back to back in one graph, the median replay over count."""
        pieces: dict[str, Callable[[], None]] = {
            "plain_step": self.plain_step,
            "verification": self.verification,
            "draft_model_loop": self.draft_loop,
            "head_loop": self.head_loop,
        }
        device = self.token.device
        with torch.no_grad():
            return {name: graph_seconds(fn, device, count) / count for name, fn in pieces.items()}
