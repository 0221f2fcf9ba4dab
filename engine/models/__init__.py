"""Llama-family model definitions and their loader (HF safetensors checkpoints, GGUF files
dequantized at load, or dummy weights)."""

from pathlib import Path

from engine.models.arch import SUPPORTED_ARCHITECTURES, ArchConfig, load_arch
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import build_model, check_quantized_parallel

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"
"""The embedded tiny model: works offline, served when no model is named."""

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchConfig", "DEFAULT_MODEL_DIR", "LlamaForCausalLM", "build_model",
           "check_quantized_parallel", "load_arch"]
