"""Loading a draft model where it runs (a decode worker's proposer, a prefill worker's draft
prefill) and naming it: two workers that exchange a draft's KV must run the same draft."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch

from engine.attention import AttentionBackend, AttentionSpec, create_backend
from engine.config import ModelConfig, SpeculativeConfig
from engine.models import DEFAULT_MODEL_DIR, ArchConfig, LlamaForCausalLM, build_model


class LoadedDraft(NamedTuple):
    model: LlamaForCausalLM
    arch: ArchConfig
    backend: AttentionBackend
    fingerprint: str  # equal for two loads of the same weights in the same dtype (draft_fingerprint)


def draft_dir(config: SpeculativeConfig) -> Path:
    assert config.draft_model is not None, "SpeculativeConfig checks this"
    return DEFAULT_MODEL_DIR if config.draft_model == "default" else Path(config.draft_model)


def load_draft(
    config: SpeculativeConfig, target: ModelConfig, target_arch: ArchConfig, device: torch.device, dtype: torch.dtype
) -> LoadedDraft:
    """The draft model of `config` in the target's dtype, load format, seed and attention backend;
    raises ValueError when it cannot draft for the target (another vocabulary)."""
    model_dir = draft_dir(config)
    model, arch = build_model(model_dir, dtype, device, target.load_format, target.seed, target.fused_ops)
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"draft_model {config.draft_model!r} has vocab_size {arch.vocab_size}; the target has "
            f"{target_arch.vocab_size}: the draft must share the target's tokenizer"
        )
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, arch.sliding_window)
    backend = create_backend(target.attention_backend, spec, device)
    return LoadedDraft(model, arch, backend, draft_fingerprint(model_dir, target, dtype))


def draft_fingerprint(model_dir: Path, target: ModelConfig, dtype: torch.dtype) -> str:
    """A name for the draft's weights as loaded: its config, its weight files (name, size and a hash
    of their first MiB, which holds the header and the first tensors), the load format, the seed of
    dummy weights and the dtype. Not a hash of every weight (an 8B draft's would take seconds): two
    copies of one checkpoint agree; a retrained one of the same shape differs in its first tensors."""
    files = sorted((p.name, p.stat().st_size, _head_hash(p)) for p in model_dir.glob("*.safetensors"))
    seed = target.seed if target.load_format == "dummy" or not files else None
    described = {
        "config": json.loads((model_dir / "config.json").read_text()),
        "files": files,
        "load_format": target.load_format,
        "seed": seed,
        "dtype": str(dtype),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _head_hash(path: Path, num_bytes: int = 1 << 20) -> str:
    with path.open("rb") as f:
        return hashlib.sha256(f.read(num_bytes)).hexdigest()[:16]


__all__ = ["LoadedDraft", "draft_dir", "draft_fingerprint", "load_draft"]
