"""Builds a model from a Hugging Face checkpoint directory (safetensors), a GGUF file (or a
directory holding one and no safetensors: gguf_file.py, gguf_weights.py), or with random weights.

Reads config.json and *.safetensors, or the GGUF's metadata and tensors; never imports
transformers. Every tensor the model needs must be in the checkpoint, and the error names the
ones that are not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.arch import ArchConfig, load_arch
from engine.models.fused_ops import HAS_TRITON
from engine.models.gguf_file import GGUFMetadata, arch_from_gguf, find_gguf
from engine.models.llama import LlamaForCausalLM
from engine.parallel import Shard, TensorParallel

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index.name} names {', '.join(missing)}, missing from the checkpoint directory {str(model_dir)!r}"
            )
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights (e.g. model.safetensors) in the checkpoint directory {str(model_dir)!r}; "
            "use load_format='dummy' for random weights"
        )
    return files


def copy_checked(param: torch.nn.Parameter, source: Any, where: str, implied_by: str,
                 dtype: torch.dtype, device: torch.device) -> None:
    """param <- source (cast and moved), or a ValueError naming `where` (the file and tensor), both
    shapes, and what implied param's (`implied_by`). source: a tensor, or a safetensors slice, of
    which only the part a tensor-parallel rank holds is read (the parameter's `shard`,
    engine/parallel/shard.py); vocabulary padding rows past the checkpoint's are zeroed."""
    shard: Shard | None = getattr(param, "shard", None)
    shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
    expected = list(param.shape)
    if shard is not None:
        expected[shard.dim] = shard.full
    if shape != tuple(expected):
        raise ValueError(f"{where} has shape {shape}, {implied_by} implies {tuple(expected)}")
    if shard is None:
        tensor, target = (source if isinstance(source, torch.Tensor) else source[:]), param
    else:
        stop = min(shard.stop, shard.full)
        index = slice(shard.start, stop)
        tensor = source[index] if shard.dim == 0 else source[:, index]
        target = param if stop - shard.start == param.shape[shard.dim] else param[: stop - shard.start]
    with torch.no_grad():
        if target is not param:
            param.zero_()
        target.copy_(tensor.to(device=device, dtype=dtype))


def load_weights(model: LlamaForCausalLM, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or name not in params:
                    continue
                source = f.get_slice(name) if hasattr(params[name], "shard") else f.get_tensor(name)
                copy_checked(params[name], source, f"{file.name}: tensor {name}", "config.json", dtype, device)
                loaded.add(name)
    tied = {"lm_head.weight"} if model.arch.tie_word_embeddings else set()
    if tied and "lm_head.weight" in loaded:
        loaded.add("model.embed_tokens.weight")
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks tensors the model needs: {shown}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights at the real shape (vLLM's load_format='dummy'): normals for matrices, ones for norms."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)


def build_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto", seed: int = 0,
    fused_ops: bool = True, tp: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, ArchConfig]:
    """model_dir: an HF checkpoint directory, a .gguf file, or a directory holding one .gguf (whose
    metadata, not a config.json, gives the architecture). fused_ops: the Triton elementwise kernels
    where they run (CUDA with triton installed). tp: build (and read) only this rank's part; dummy
    weights then differ per rank (each draws its own part)."""
    model_dir = Path(model_dir)
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None and load_format == "safetensors":
        raise ValueError(
            f"load_format='safetensors' but {str(model_dir)!r} is a GGUF checkpoint; use load_format='auto'"
        )
    gguf = GGUFMetadata.open(gguf_path) if gguf_path is not None else None
    arch = arch_from_gguf(gguf) if gguf is not None else load_arch(model_dir)
    # fail before allocating
    files = [] if load_format == "dummy" or gguf is not None else safetensors_files(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # NOTE: build in the target dtype: an 8B model never exists in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(arch, tp)
    finally:
        torch.set_default_dtype(previous)
    if gguf is not None and load_format != "dummy":
        from engine.models.gguf_weights import load_gguf_weights  # NOTE: imports the gguf package

        load_gguf_weights(model, gguf, dtype, device)
    elif files:
        load_weights(model, model_dir, dtype, device)
    else:
        init_dummy_weights(model, seed)
    model.eval()
    model.use_fused_ops(fused_ops and device.type == "cuda" and HAS_TRITON)
    return model, arch
