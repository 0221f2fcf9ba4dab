"""The shape of a worker's paged KV cache, as two workers compare it when a pair forms, and the
gather/scatter between scattered block ids and one contiguous transfer buffer.

The KV cache of a worker is ONE tensor:

    kv: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]

Block ids index dim 2. `num_blocks` is a worker's own business (pools differ in size) and is not
part of the layout; everything else must match on both ends of a pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from engine.pinned import upload

__all__ = [
    "KvLayout", "LayoutMismatchError", "gather_blocks", "scatter_blocks", "DTYPES",
]

# NOTE: append only. A dtype is exchanged as its index in this table, so reordering it would make
# two builds of pdserve disagree about what they are sending.
DTYPES: tuple[str, ...] = (
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float64", "int8", "uint8",
)

# Version tag at the head of the int encoding: a peer speaking another encoding fails loudly.
_INTS_MAGIC = 0x4B56_0002  # "KV", version 2 (version 1 had no KV scales)
_KV_NDIM = 6


class LayoutMismatchError(ValueError):
    """Two workers' KV layouts differ; raised on both sides when a pair forms."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KvLayout:
    """Everything about a KV cache that both ends of a transfer must agree on."""

    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # a name from DTYPES, e.g. "float16"
    # an FP8 cache's per-layer scales, as engine/quant/kv_scales.py fingerprints them (0: a unit scale):
    # blocks stored under one layer's scales mean other values under another's
    scales: int = 0

    # [magic, num_layers, block_size, num_kv_heads, head_dim, dtype index, scales]
    NUM_INTS = 7

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KvLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.scales, int) or not 0 <= self.scales < 1 << 31:
            raise ValueError(f"KvLayout.scales must be a 31-bit fingerprint, got {self.scales!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KvLayout.dtype {self.dtype!r} is not supported; supported: {', '.join(DTYPES)}")

    @classmethod
    def from_kv(cls, kv: torch.Tensor, scales: int = 0) -> KvLayout:
        """The layout of a cache tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim] holding
        values under the KV scales of fingerprint `scales`."""
        if kv.dim() != _KV_NDIM or kv.shape[1] != 2:
            raise ValueError(
                "a KV cache must have shape [layers, 2, num_blocks, block_size, kv_heads, head_dim]; "
                f"got {tuple(kv.shape)}"
            )
        layers, _, _, block_size, kv_heads, head_dim = kv.shape
        return cls(layers, block_size, kv_heads, head_dim, _dtype_name(kv.dtype), scales)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a contiguous transfer buffer holding `num_blocks` blocks of every layer."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_ints(self) -> torch.Tensor:
        """Fixed-length int64 encoding, [NUM_INTS], for exchanging over a process group."""
        values = [_INTS_MAGIC, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                  DTYPES.index(self.dtype), self.scales]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_ints(cls, ints: torch.Tensor | Sequence[int]) -> KvLayout:
        values = [int(v) for v in (ints.tolist() if isinstance(ints, torch.Tensor) else ints)]
        if len(values) != cls.NUM_INTS or values[0] != _INTS_MAGIC:
            raise LayoutMismatchError(
                f"the peer's layout encoding is not KvLayout v2 (got {values[:cls.NUM_INTS]}); "
                "are both workers running the same pdserve version?"
            )
        _, layers, block_size, kv_heads, head_dim, dtype_index, scales = values
        if not 0 <= dtype_index < len(DTYPES):
            raise LayoutMismatchError(f"the peer's dtype index {dtype_index} is unknown to this worker "
                                      f"(known: 0..{len(DTYPES) - 1}); upgrade this worker")
        return cls(layers, block_size, kv_heads, head_dim, DTYPES[dtype_index], scales)

    def check_compatible(self, other: KvLayout) -> None:
        """Raise LayoutMismatchError naming every field that differs ("self" is this worker)."""
        def shown(layout: KvLayout, name: str) -> object:
            value = getattr(layout, name)
            return value if name != "scales" else f"per-layer scales {value:#010x}" if value else "a unit scale"

        diffs = [
            f"{f.name}: this worker has {shown(self, f.name)}, the peer has {shown(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise LayoutMismatchError(
                "KV layouts differ, so blocks cannot move between these workers: " + "; ".join(diffs)
                + ". Serve the same model (the same checkpoint's KV scales) with the same cache config "
                "(block_size, kv dtype) on both."
            )


def _block_index(kv: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """block ids as an int64 tensor [n] on kv's device. Python sequences are range-checked here
    (no device sync needed); tensors are trusted (index_select/index_copy_ check bounds)."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=kv.device, dtype=torch.int64)
    num_blocks = kv.shape[2]
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} are out of range for a cache of {num_blocks} blocks")
    return upload(list(block_ids), torch.int64, kv.device)  # NOTE: waits for no queued work


def _as_block_rows(kv: torch.Tensor) -> torch.Tensor:
    """kv [layers, 2, blocks, ...] as [layers * 2, blocks, words]: each block of a layer's K or V one
    row of the widest integer words its bytes divide into. NOTE: index_select/index_copy_ move one
    element per thread, so 8-byte words move a block 4x faster than its bf16 values (measured on an
    H100: a 256 MiB gather ran at ~1 TB/s as int64 words, a third of that as bf16 elements)."""
    rows = kv.view(kv.shape[0] * kv.shape[1], kv.shape[2], -1)
    row_bytes = rows.shape[2] * rows.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and size >= rows.element_size():
            return rows.view(word)
    return rows


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Copy the given blocks of every layer into one new contiguous buffer.

    kv:      [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    returns: [layers, 2, n,          block_size, kv_heads, head_dim]   (n = len(block_ids), in order)
    """
    index = _block_index(kv, block_ids)
    buf = torch.empty((*kv.shape[:2], index.numel(), *kv.shape[3:]), dtype=kv.dtype, device=kv.device)
    torch.index_select(_as_block_rows(kv), 1, index, out=_as_block_rows(buf))  # one kernel
    return buf


def scatter_blocks(kv: torch.Tensor, block_ids: torch.Tensor | Sequence[int], buf: torch.Tensor) -> None:
    """Write buf's blocks into kv at the given block ids (buf's i-th block -> block_ids[i]).

    kv:  [layers, 2, num_blocks, block_size, kv_heads, head_dim]   (written in place)
    buf: [layers, 2, n,          block_size, kv_heads, head_dim]
    Block ids must be distinct: with a duplicate, which block lands there is undefined.
    """
    index = _block_index(kv, block_ids)
    expected = (*kv.shape[:2], index.numel(), *kv.shape[3:])
    if tuple(buf.shape) != expected or buf.dtype != kv.dtype:
        raise ValueError(f"scatter_blocks: buffer is {tuple(buf.shape)} {buf.dtype}, expected {expected} "
                         f"{kv.dtype} for {index.numel()} block ids")
    _as_block_rows(kv).index_copy_(1, index, _as_block_rows(buf))
