"""Quantized weights: FP8 (E4M3) projections with per-channel weight and per-token activation
scales (fp8.py), quantized at load or read from FP8 checkpoints (checkpoint.py, convert.py).
Knows nothing of scheduling, attention or the KV cache."""

from engine.quant.checkpoint import CheckpointQuant, checkpoint_quant
from engine.quant.convert import convert_to_fp8
from engine.quant.fp8 import FP8, Fp8Matmul, Fp8Path, fp8_path, quantize_rows

__all__ = ["FP8", "CheckpointQuant", "Fp8Matmul", "Fp8Path", "checkpoint_quant", "convert_to_fp8", "fp8_path",
           "quantize_rows"]
