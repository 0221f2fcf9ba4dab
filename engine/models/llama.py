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
from engine.models.fused_ops import DecoderOps, rms_norm_ref
from engine.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalize in float32, cast back, then scale: transformers' order, for equal outputs.
        return rms_norm_ref(x, self.weight, self.eps)


def fused_linears(owner: nn.Module, name: str, parts: dict[str, int], in_features: int, bias: bool) -> None:
    """nn.Linear modules `parts` (name -> out_features) whose weights (and biases) are row slices
    of one tensor, buffer `<name>_weight` (`<name>_bias`): checkpoints load by the parts' names,
    the forward multiplies once. The parts are views, so nothing is stored twice."""
    total = sum(parts.values())
    owner.register_buffer(f"{name}_weight", torch.empty(total, in_features), persistent=False)
    owner.register_buffer(f"{name}_bias", torch.zeros(total) if bias else None, persistent=False)
    start = 0
    for part, rows in parts.items():
        linear = nn.Linear(in_features, rows, bias=bias, device="meta")
        linear.weight = nn.Parameter(getattr(owner, f"{name}_weight")[start : start + rows])
        if bias:
            linear.bias = nn.Parameter(getattr(owner, f"{name}_bias")[start : start + rows])
        setattr(owner, part, linear)
        start += rows


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        hidden = arch.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        fused_linears(self, "qkv", parts, hidden, arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=arch.o_bias)
        self.qk_norm = arch.qk_norm
        self.eps = arch.rms_norm_eps
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
        ops: DecoderOps,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [tokens, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q = ops.norm_rope(q, cos, sin, self.q_norm.weight if self.qk_norm else None, self.eps)
        k = ops.norm_rope(k, cos, sin, self.k_norm.weight if self.qk_norm else None, self.eps)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden, inter = arch.hidden_size, arch.intermediate_size
        fused_linears(self, "gate_up", {"gate_proj": inter, "up_proj": inter}, hidden, arch.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(F.linear(x, self.gate_up_weight, self.gate_up_bias)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(  # type: ignore[no-untyped-def]
        self, x, residual, cos_sin, kv_cache, meta, backend, ops: DecoderOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to residual (None before the first layer).
        Returns this layer's (output, residual); the sum of the two is transformers' hidden state."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn(h, cos_sin, kv_cache, meta, backend, ops)
        h, residual = ops.add_rms_norm(x, residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
        return self.mlp(h, ops), residual


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
        self.ops = DecoderOps(triton=False)  # `use_fused_ops` switches to the Triton kernels

    def use_fused_ops(self, enabled: bool) -> None:
        """Triton kernels for RMSNorm (+ residual), q/k norm + rotary and SwiGLU: CUDA only."""
        self.ops = DecoderOps(triton=enabled)

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
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos_sin, kv_caches[i], meta, backend, self.ops)
        return self.ops.add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return self.lm_head(hidden).float()
