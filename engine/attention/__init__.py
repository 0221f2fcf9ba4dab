"""Attention over the paged KV cache: the backend interface, a registry by name, the torch
reference backend (any device; CPU and tests) and the Triton backend (CUDA; checked on the CPU
under TRITON_INTERPRET=1). Importing this package does not import triton."""

from engine.attention import torch_ref as _torch_ref  # noqa: F401  (registers "torch")
from engine.attention import triton_backend as _triton_backend  # noqa: F401  (registers "triton")
from engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    DecodeRotation,
    available_backends,
    create_backend,
    register_backend,
    write_kv,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "DecodeRotation",
    "available_backends",
    "create_backend",
    "register_backend",
    "write_kv",
]
