"""GGUF files for the tests: bench/gguf_write.py's writer (an HF checkpoint as llama.cpp converts it), and
random K-quant blocks for types the tests need as raw bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from bench.gguf_write import permute, write_gguf

__all__ = ["permute", "random_k_quant", "write_gguf"]

# Bytes per 256-value block, where its float16 super-block scales sit (d, then dmin if any), and
# the value they get (random sub-block scales and values then make weights of ~0.02 mean size).
_K_QUANT_LAYOUT = {GGMLQuantizationType.Q4_K: (144, (0, 2), 1e-4), GGMLQuantizationType.Q5_K: (176, (0, 2), 5e-5),
                   GGMLQuantizationType.Q6_K: (210, (208,), 2e-5)}


def random_k_quant(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random blocks of a K-quant type (which the gguf package reads but cannot write) for a
    [rows, cols] matrix: random bytes, with the float16 super-block scales set to small values so
    the weights are ~0.02 in size. -> uint8 [rows, cols / 256 * block bytes]."""
    size, scale_offsets, d = _K_QUANT_LAYOUT[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[..., offset : offset + 2] = np.full(blocks.shape[:2], d, dtype=np.float16).view(np.uint8).reshape(
            *blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)

