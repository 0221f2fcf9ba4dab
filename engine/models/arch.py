"""The architecture of a Llama-family checkpoint, read from its `config.json`.

Knows the config keys of Llama 2/3, Mistral, Qwen2 and Qwen3 in both transformers 4.x spelling
(`rope_theta`, `rope_scaling`) and 5.x spelling (`rope_parameters`); knows nothing of weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    # name -> the family features it switches on
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def arch_from_dict(raw: dict[str, Any], source: str = "config.json") -> ArchConfig:
    names = raw.get("architectures") or []
    known = [n for n in names if n in SUPPORTED_ARCHITECTURES]
    if not known:
        raise ValueError(
            f"{source}: architecture {names or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    name = known[0]
    features = SUPPORTED_ARCHITECTURES[name]
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    sliding = raw.get("sliding_window")
    if name.startswith("Qwen") and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen configs carry a window size but only use it when asked to
    attention_bias = bool(raw.get("attention_bias", False))
    return ArchConfig(
        architecture=name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=features["qkv_bias"] or attention_bias,
        o_bias=attention_bias and name == "LlamaForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=features["qk_norm"],
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def load_arch(model_dir: str | Path) -> ArchConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"config.json is missing from the checkpoint directory {str(model_dir)!r}")
    raw = json.loads(path.read_text())
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        # NOTE: generation_config.json's eos ids win, as in transformers' generate().
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            raw = {**raw, "eos_token_id": eos}
    return arch_from_dict(raw, source=str(path))
