"""What every attention backend receives and promises.

A backend writes the step's new K/V into their paged slots and attends each sequence's queries
over its whole context (cached prefix + new tokens), causally, with grouped-query heads.
It knows nothing of scheduling: the runner hands it flat tensors and an `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple, Protocol

import torch

from engine.quant.fp8 import FP8, FP8_MAX


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch, flattened.

    Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]); those rows sit at
    positions [seq_lens[i] - num_new, seq_lens[i]) of its context, so the cached prefix is
    seq_lens[i] - num_new tokens long.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]  # [num_seqs + 1], host
    seq_lens: list[int]  # [num_seqs] context length after this step, host
    block_tables: list[list[int]]  # per sequence, host; block ids covering seq_lens[i]
    block_tables_tensor: torch.Tensor  # [num_seqs, max_blocks] int32 on the device, padded with 0
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32 on the device
    query_start_loc_tensor: torch.Tensor  # [num_seqs + 1] int32 on the device
    max_query_len: int
    max_seq_len: int
    # A graph step's rows may be positions of one sequence, each attending as a one-query sequence of its own
    # (engine/cuda_graphs.py): every row's key must be in the cache before any row attends.
    rows_share_sequences: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class DecodeRotation(NamedTuple):
    """What a decode launch needs to rotate a step's queries and store its keys and values itself (a backend that
    `rotates` the batch): each token's cos and sin rows [tokens, head_dim] (the activations' dtype), the unrotated
    keys and the values [tokens, kv heads, head_dim] (views of qkv), q's factor (a scaled cache's k_scale, else
    1.0) and the float32 reciprocals of the cache's scales (fused_ops.KVStore's rounding)."""

    cos: torch.Tensor
    sin: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: float
    k_inverse: float
    v_inverse: float


class AttentionBackend(Protocol):
    name: ClassVar[str]
    supports_cpu: ClassVar[bool]
    supports_cuda: ClassVar[bool]
    supports_cuda_graphs: ClassVar[bool]  # its decode launch can be captured (engine/cuda_graphs.py)
    takes_stored_kv: ClassVar[bool]  # forward takes k = v = None: the new K/V are in the caches already

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: stored (takes_stored_kv)
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    def rotates(self, meta: AttentionMetadata) -> bool:
        """Whether forward_rotated serves this batch (and pays)."""
        ...

    def crowded_decode_seqs(self, device: torch.device) -> int | None:
        """The decoding sequences from which a decode launch on `device` takes other tiles (a kernel variant of
        its own, which the start-up warm-up must reach); None: the same tiles at any batch."""
        ...

    def crowded_prefill_tokens(self, device: torch.device) -> int | None:
        """The new prompt tokens (of one launch) from which a prefill launch on `device` takes other tiles (a kernel
        variant of its own, which the start-up warm-up must reach); None: the same tiles at any size."""
        ...

    def forward_rotated(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence, not yet rotated
        rotation: DecodeRotation,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        """Where `rotates`: a decode-only batch's attention, its queries rotated (and scaled) and its keys
        (rotated) and values stored in the decode launch, as the rotary kernel and forward would."""
        ...


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None


_BACKENDS: dict[str, Callable[[AttentionSpec], AttentionBackend]] = {}


def register_backend(cls: type) -> type:
    """Class decorator: makes a backend available by its `name`."""
    _BACKENDS[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, spec: AttentionSpec, device: torch.device) -> AttentionBackend:
    if name == "auto":
        candidates = [n for n, c in _BACKENDS.items() if _fits(c, device)]
        # Prefer anything faster than the reference when the device allows it.
        candidates.sort(key=lambda n: n == "torch")
        if not candidates:
            raise ValueError(f"no attention backend runs on {device}; registered: {available_backends()}")
        name = candidates[0]
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; available: {', '.join(available_backends())}")
    cls = _BACKENDS[name]
    if not _fits(cls, device):
        raise ValueError(f"attention backend {name!r} does not run on {device.type}")
    return cls(spec)


def _fits(cls: object, device: torch.device) -> bool:
    return bool(getattr(cls, "supports_cuda" if device.type == "cuda" else "supports_cpu"))


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: cast, or for FP8 (E4M3, a unit scale) clamped to
    +-448 and rounded to nearest even (the Triton store kernel rounds alike)."""
    if cache_dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(cache_dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V into their paged slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for new, cache in ((k, k_cache), (v, v_cache)):
        # NOTE: as raw bytes when FP8: torch's CPU index_copy_ has no float8 kernel
        rows, values = cache.view(-1, num_kv_heads, head_dim), to_cache(new, cache.dtype)
        if cache.element_size() == 1:
            rows, values = rows.view(torch.uint8), values.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, values)
