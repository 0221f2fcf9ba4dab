"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Module names equal Hugging Face's, so a checkpoint's tensors load by name. Tokens of all
sequences in a step are concatenated ([num_tokens, hidden]); attention over the paged cache is
the backend's business. Knows nothing of scheduling or sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.arch import ArchConfig
from engine.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalize in float32, cast back, then scale: transformers' order, for equal outputs.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        hidden = arch.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=arch.o_bias)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden, inter = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(hidden, inter, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, meta, backend) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.rope, arch.head_dim)


class LlamaForCausalLM(nn.Module):
    """One class for the family; `ArchConfig` switches qkv bias, q/k norm and rope scaling."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaBody(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # hidden states [tokens, hidden]
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, kv_caches[i], meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return self.lm_head(hidden).float()
