"""Attention over the paged KV cache: the backend interface, a registry by name, and the torch
reference backend (CPU and tests). The Triton backend registers itself here when it lands."""

from engine.attention import torch_ref as _torch_ref  # noqa: F401  (registers "torch")
from engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    available_backends,
    create_backend,
    register_backend,
    write_kv,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "available_backends",
    "create_backend",
    "register_backend",
    "write_kv",
]
