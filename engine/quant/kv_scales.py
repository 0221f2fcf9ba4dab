"""Per-layer FP8 KV-cache scales, as FP8 checkpoints publish them.

A scale s of a layer's K (or V) means the cache holds K / s in E4M3 and K is s times what it holds
(vLLM's and llm-compressor's convention). Read from the checkpoint's safetensors, one scalar a layer:
`model.layers.N.self_attn.k_scale` and `.v_scale` (compressed-tensors' kv_cache_scheme), else
`.k_proj.output_scale` and `.v_proj.output_scale` (AutoFP8), else one `.kv_scale` for both. A checkpoint
holds them for every layer or for none; with none, the cache keeps a unit scale.

The model applies them in its attention (engine/models/llama.py): queries times k_scale and new keys
over it (their dot products unchanged), new values over v_scale and the attention's output times it,
so no attention backend knows of them. Both ends of a KV transfer must hold the same scales:
`fingerprint` goes into the layout they compare (kvtransfer/layout.py).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

KvScales = tuple[tuple[float, float], ...]
"""(k_scale, v_scale) per layer."""

_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


def read_kv_scales(files: Sequence[Path], num_layers: int) -> KvScales | None:
    """The checkpoint's per-layer KV scales (None: it has none). Raises ValueError naming the tensor
    when a layer lacks its scale, a scale is not one positive finite number, or naming is mixed."""
    found: dict[str, tuple[str, float]] = {}  # tensor name -> (file, value)
    wanted = {f"model.layers.{i}.{n}" for i in range(num_layers) for pair in _NAMES for n in pair}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name in wanted:
                    tensor = handle.get_tensor(name)
                    where = f"{file.name}: tensor {name}"
                    if tensor.numel() != 1:
                        raise ValueError(f"{where} has shape {tuple(tensor.shape)}; a KV-cache scale is one number "
                                         "per layer (per-head KV scales are not supported)")
                    value = float(tensor.float().reshape(()))
                    if not math.isfinite(value) or value <= 0:
                        raise ValueError(f"{where} is {value}; a KV-cache scale must be positive and finite")
                    found[name] = (where, value)
    if not found:
        return None
    for k_name, v_name in _NAMES:
        names = [(f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}") for i in range(num_layers)]
        present = [n for pair in names for n in pair if n in found]
        if not present:
            continue
        missing = [n for pair in names for n in pair if n not in found]
        if missing:
            raise ValueError(f"the checkpoint has KV-cache scales ({found[present[0]][0]}) but not for every layer: "
                             f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} missing")
        others = sorted(set(found) - {n for pair in names for n in pair})
        if others:
            raise ValueError(f"the checkpoint names its KV-cache scales two ways: {present[0]} and {others[0]}")
        return tuple((found[k][1], found[v][1]) for k, v in names)
    raise AssertionError("unreachable: every found name belongs to one naming")


def fingerprint(scales: KvScales | None) -> int:
    """A 31-bit fingerprint of the scales as float32 (0: none, a unit scale), for KvLayout."""
    if scales is None:
        return 0
    data = b"".join(struct.pack("<ff", k, v) for k, v in scales)
    return (zlib.crc32(data) & 0x7FFF_FFFF) or 1
