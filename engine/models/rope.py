"""Rotary position embeddings (default, linear and Llama 3 scaling), computed as transformers does:
inverse frequencies and cos/sin in float32, rotation in the activations' dtype."""

from __future__ import annotations

import math

import torch

from engine.models.arch import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [tokens, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [tokens, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
