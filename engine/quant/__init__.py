"""Quantized weights: FP8 (E4M3) projections with per-channel weight and per-token activation
scales (fp8.py), quantized at load or read from FP8 checkpoints; 4-bit weight-only projections
read from AutoAWQ checkpoints (int4.py); how checkpoints declare them (checkpoint.py) and how a
model's projections take the storage (convert.py). Knows nothing of scheduling or attention; the
FP8 KV cache is the attention's (engine/attention/base.py)."""

from engine.quant.checkpoint import CheckpointQuant, checkpoint_quant
from engine.quant.convert import convert_to_fp8, convert_to_int4
from engine.quant.fp8 import FP8, Fp8Matmul, Fp8Path, fp8_path, quantize_rows
from engine.quant.int4 import Int4Matmul, Int4Path, int4_path

__all__ = ["FP8", "CheckpointQuant", "Fp8Matmul", "Fp8Path", "Int4Matmul", "Int4Path", "checkpoint_quant",
           "convert_to_fp8", "convert_to_int4", "fp8_path", "int4_path", "quantize_rows"]
