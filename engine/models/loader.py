"""Builds a model from a Hugging Face checkpoint directory (safetensors), a GGUF file (or a
directory holding one and no safetensors: gguf_file.py, gguf_weights.py), or with random weights.

Reads config.json and *.safetensors, or the GGUF's metadata and tensors; never imports
transformers. Every tensor the model needs must be in the checkpoint, and the error names the
ones that are not.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.models.arch import ArchConfig, load_arch
from engine.models.fused_ops import HAS_TRITON
from engine.models.gguf_file import GGUFMetadata, arch_from_gguf, find_gguf
from engine.models.llama import LlamaForCausalLM
from engine.parallel import Shard, TensorParallel
from engine.quant import convert_to_fp8, convert_to_int4, int4_path
from engine.quant.int4 import pack_nibbles, unpack_awq_columns, unpack_gptq_columns, unpack_gptq_rows
from engine.quant.checkpoint import (SCALE_SUFFIXES, CheckpointQuant, channel_scales, checkpoint_quant,
                                     dequantize_blocks)
from engine.quant.fp8 import FP8, fp8_path, quantize_rows
from engine.quant.kv_scales import KvScales, read_kv_scales

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


def checkpoint_kv_scales(model_dir: str | Path, load_format: str, num_layers: int) -> KvScales | None:
    """The per-layer FP8 KV-cache scales an HF checkpoint publishes (engine/quant/kv_scales.py); None for
    one without, a GGUF file, or random weights."""
    model_dir = Path(model_dir)
    if load_format == "dummy" or find_gguf(model_dir) is not None:
        return None
    return read_kv_scales(safetensors_files(model_dir), num_layers)


def checkpoint_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole checkpoint tensor `param` holds (part of, with tensor parallelism: its
    `shard`, engine/parallel/shard.py); a 4-bit weight's (uint8, two values a byte) unpacked."""
    shape = list(param.shape)
    if param.dtype == torch.uint8:
        shape[-1] *= 2
    shard: Shard | None = getattr(param, "shard", None)
    if shard is not None:
        shape[shard.dim] = shard.full
    return tuple(shape)


def read_checked(param: torch.Tensor, source: Any, where: str, implied_by: str) -> torch.Tensor:
    """The part of `source` that `param` holds, or a ValueError naming `where` (the file and tensor),
    both shapes, and what implied param's (`implied_by`). source: a tensor, or a safetensors slice,
    of which only the part a tensor-parallel rank holds is read (the parameter's `shard`,
    engine/parallel/shard.py); rows of a vocabulary padded past the checkpoint's are left out."""
    shard: Shard | None = getattr(param, "shard", None)
    shape = tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())
    if shape != checkpoint_shape(param):
        raise ValueError(f"{where} has shape {shape}, {implied_by} implies {checkpoint_shape(param)}")
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    index = slice(shard.start, min(shard.stop, shard.full))
    return source[index] if shard.dim == 0 else source[:, index]


def copy_checked(param: torch.Tensor, source: Any, where: str, implied_by: str,
                 dtype: torch.dtype, device: torch.device) -> None:
    """param <- read_checked(source) cast and moved; vocabulary padding rows are zeroed. An FP8
    weight (engine/quant/convert.py) from a source of another dtype is quantized per row, its
    scales written to `param.quant_scale`; from an FP8 source it is copied as is (scales: the caller)."""
    if param.dtype == torch.uint8:
        raise ValueError(f"{where} is not 4-bit, but the model's 4-bit weights load from the checkpoint's 4-bit "
                         "tensors only (qweight, qzeros, scales)")
    tensor = read_checked(param, source, where, implied_by).to(device)
    target = param if tensor.shape == param.shape else param[: tensor.shape[0]]
    with torch.no_grad():
        if target is not param:
            param.zero_()
        if param.dtype == FP8 and tensor.dtype != FP8:
            q, scale = quantize_rows(tensor)
            target.copy_(q)
            param.quant_scale.copy_(scale.view(-1))  # type: ignore[attr-defined]
        else:
            target.copy_(tensor.to(dtype=param.dtype if param.dtype == FP8 else dtype))


class CheckpointReader:
    """Every tensor of a checkpoint's safetensors files, by name (a scale may sit in another file
    than its weight); open until `close`."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = ExitStack()
        self._where: dict[str, tuple[str, Any]] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                self._where[name] = (file.name, handle)

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def where(self, name: str) -> str:
        return f"{self._where[name][0]}: tensor {name}"

    def tensor(self, name: str) -> torch.Tensor:
        return self._where[name][1].get_tensor(name)

    def slice(self, name: str) -> Any:
        return self._where[name][1].get_slice(name)

    def is_fp8(self, name: str) -> bool:
        return self.slice(name).get_dtype() == "F8_E4M3"

    def close(self) -> None:
        self._stack.close()


def _load_fp8_weight(param: torch.nn.Parameter, reader: CheckpointReader, name: str, quant: CheckpointQuant,
                     device: torch.device) -> None:
    """An FP8 linear's weight and scales from a checkpoint that stores it in FP8 (`quant`'s format)."""
    scales = name + "_scale"
    if not reader.has(scales):
        raise ValueError(f"{reader.where(name)} is float8_e4m3fn ({quant.format}) but its scale tensor "
                         f"{scales} is missing from the checkpoint")
    copy_checked(param, reader.slice(name), reader.where(name), "config.json", FP8, device)
    scale = param.quant_scale  # type: ignore[attr-defined]
    shard: Shard | None = getattr(scale, "shard", None)
    full = channel_scales(reader.tensor(scales), shard.full if shard is not None else scale.shape[0],
                          reader.where(scales))
    copy_checked(scale, full, reader.where(scales), "config.json", torch.float32, device)


def _load_int4_weight(param: torch.nn.Parameter, reader: CheckpointReader, prefix: str, quant: CheckpointQuant,
                      device: torch.device) -> None:
    """A 4-bit weight (engine/quant/int4.py) from AWQ's or GPTQ's qweight, qzeros and scales of `prefix`."""
    names = {part: f"{prefix}.{part}" for part in ("qweight", "qzeros", "scales")}
    for part, name in names.items():
        if not reader.has(name):
            raise ValueError(f"{reader.where(names['qweight'])} is 4-bit ({quant.format}) but its {part} tensor "
                             f"{name} is missing from the checkpoint")
    (out, inp), group = checkpoint_shape(param), quant.group_size
    qweight_shape = (inp, out // 8) if quant.format == "awq" else (inp // 8, out)
    expected = {"qweight": qweight_shape, "qzeros": (inp // group, out // 8), "scales": (inp // group, out)}
    tensors = {}
    for part, name in names.items():
        tensor = reader.tensor(name)
        if tuple(tensor.shape) != expected[part]:
            raise ValueError(f"{reader.where(name)} has shape {tuple(tensor.shape)}; config.json (group_size {group}) "
                             f"implies {expected[part]}")
        tensors[part] = tensor.to(device)
    if quant.format == "awq":
        q, zeros = unpack_awq_columns(tensors["qweight"]).t(), unpack_awq_columns(tensors["qzeros"]).t()
    else:
        g_idx = f"{prefix}.g_idx"
        if reader.has(g_idx) and not torch.equal(reader.tensor(g_idx).long(), torch.arange(inp) // group):
            raise ValueError(f"{reader.where(g_idx)} does not map input column k to group k // {group}: an act-order "
                             "checkpoint (desc_act) whose config.json says otherwise")
        q, zeros = unpack_gptq_rows(tensors["qweight"]).t(), unpack_gptq_columns(tensors["qzeros"]).t()
    zeros = zeros + quant.zero_offset  # [out, groups]; q: [out, in]
    copy_int4(param, q, tensors["scales"].t(), zeros, group)


def copy_int4(param: torch.nn.Parameter, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group: int) -> None:
    """A 4-bit weight param <- the whole checkpoint tensor's values q [out, in] (in [0, 15]), scales and
    zero points [out, in / group], of which a tensor-parallel rank keeps its `shard` (rows; or columns,
    whole groups: engine/quant/convert.py checks that a rank's columns are)."""
    shard: Shard | None = getattr(param, "shard", None)
    if shard is not None and shard.dim == 0:
        rows = slice(shard.start, shard.stop)
        q, scales, zeros = q[rows], scales[rows], zeros[rows]
    elif shard is not None:
        q = q[:, shard.start : shard.stop]
        scales, zeros = (t[:, shard.start // group : shard.stop // group] for t in (scales, zeros))
    with torch.no_grad():
        param.copy_(pack_nibbles(q))
        param.quant_scale.copy_(torch.stack((scales.to(torch.float16), zeros.to(torch.float16)), -1))


def load_weights(model: LlamaForCausalLM, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 quant: CheckpointQuant) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    reader = CheckpointReader(safetensors_files(model_dir))
    try:
        for name in reader.names():
            if name.endswith(".qweight") and name.removesuffix(".qweight") + ".weight" in params:
                weight = name.removesuffix(".qweight") + ".weight"
                if params[weight].dtype != torch.uint8:
                    raise ValueError(f"{reader.where(name)} is 4-bit, but config.json has no awq or gptq "
                                     "quantization_config")
                _load_int4_weight(params[weight], reader, name.removesuffix(".qweight"), quant, device)
                loaded.add(weight)
                continue
            if name.endswith(_IGNORED_SUFFIXES) or name.endswith(SCALE_SUFFIXES) or name not in params:
                continue  # NOTE: scales are read with their weights
            param = params[name]
            if not reader.is_fp8(name):
                source = reader.slice(name) if hasattr(param, "shard") else reader.tensor(name)
                copy_checked(param, source, reader.where(name), "config.json", dtype, device)
            elif quant.format == "fp8-block":
                scales = name + "_scale_inv"
                if not reader.has(scales):
                    raise ValueError(f"{reader.where(name)} is float8_e4m3fn (fp8-block) but its scale tensor "
                                     f"{scales} is missing from the checkpoint")
                weight = dequantize_blocks(reader.tensor(name).to(device), reader.tensor(scales).to(device),
                                           quant.block, reader.where(scales))
                copy_checked(param, weight, reader.where(name), "config.json", dtype, device)
            elif not quant.is_fp8:
                raise ValueError(f"{reader.where(name)} is float8_e4m3fn but config.json has no quantization_config "
                                 "saying how it is scaled")
            elif param.dtype != FP8:
                raise ValueError(f"{reader.where(name)} is float8_e4m3fn, but {name} is not a linear pdserve runs "
                                 "in FP8")
            else:
                _load_fp8_weight(param, reader, name, quant, device)
            loaded.add(name)
    finally:
        reader.close()
    tied = {"lm_head.weight"} if model.arch.tie_word_embeddings else set()
    if tied and "lm_head.weight" in loaded:
        loaded.add("model.embed_tokens.weight")
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks tensors the model needs: {shown}")


def read_checkpoint_quant(model_dir: Path) -> CheckpointQuant:
    path = model_dir / "config.json"
    return checkpoint_quant(json.loads(path.read_text()), str(path))


def check_quantized_parallel(model_dir: Path, tensor_parallel_size: int) -> None:
    """Before any rank starts: a ValueError when the checkpoint's 4-bit groups would straddle the ranks'
    columns of o_proj or down_proj."""
    if tensor_parallel_size == 1 or find_gguf(model_dir) is not None:
        return
    quant = read_checkpoint_quant(model_dir)
    if not quant.is_int4:
        return
    arch = load_arch(model_dir)
    for name, columns in (("o_proj", arch.num_heads * arch.head_dim), ("down_proj", arch.intermediate_size)):
        if (columns // tensor_parallel_size) % quant.group_size:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} gives each rank {columns // tensor_parallel_size} of "
                f"{name}'s {columns} input columns, not whole 4-bit groups of {quant.group_size}; use a size whose "
                "share is a multiple of the group size")


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights at the real shape (vLLM's load_format='dummy'): normals for matrices, ones for norms."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif param.dtype == torch.uint8:  # 4-bit: uniform values about a zero point of 8, std ~0.02
                param.random_(0, 256, generator=gen)
                param.quant_scale[..., 0].fill_(0.0043)  # type: ignore[attr-defined]
                param.quant_scale[..., 1].fill_(8.0)  # type: ignore[attr-defined]
            elif param.dtype == FP8:  # quantized per row; a tensor-parallel rank's part only, as its others
                normal = torch.empty(param.shape, device=param.device).normal_(0.0, 0.02, generator=gen)
                q, scale = quantize_rows(normal)
                param.copy_(q)
                param.quant_scale.copy_(scale.view(-1))  # type: ignore[attr-defined]
            else:
                param.normal_(0.0, 0.02, generator=gen)


def build_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, load_format: str = "auto", seed: int = 0,
    fused_ops: bool = True, tp: TensorParallel | None = None, quantization: str = "auto",
) -> tuple[LlamaForCausalLM, ArchConfig]:
    """model_dir: an HF checkpoint directory, a .gguf file, or a directory holding one .gguf (whose
    metadata, not a config.json, gives the architecture). fused_ops: the Triton elementwise kernels
    where they run (CUDA with triton installed). tp: build (and read) only this rank's part; dummy
    weights then differ per rank (each draws its own part). quantization: 'fp8' runs the decoder's
    projections in FP8 (engine/quant/), quantizing other weights per row as they load; 'auto' does
    so when the checkpoint is FP8 and otherwise keeps `dtype`."""
    if quantization not in ("auto", "fp8"):
        raise ValueError(f"quantization is {quantization!r}; known: 'auto', 'fp8'")
    model_dir = Path(model_dir)
    gguf_path = find_gguf(model_dir)
    if gguf_path is not None and load_format == "safetensors":
        raise ValueError(
            f"load_format='safetensors' but {str(model_dir)!r} is a GGUF checkpoint; use load_format='auto'"
        )
    gguf = GGUFMetadata.open(gguf_path) if gguf_path is not None else None
    arch = arch_from_gguf(gguf) if gguf is not None else load_arch(model_dir)
    quant = CheckpointQuant() if gguf is not None else read_checkpoint_quant(model_dir)
    # fail before allocating
    files = [] if load_format == "dummy" or gguf is not None else safetensors_files(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # NOTE: build in the target dtype: an 8B model never exists in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(arch, tp)
    finally:
        torch.set_default_dtype(previous)
    if quant.is_int4 and quantization == "fp8":
        raise ValueError(f"{str(model_dir)!r} is a 4-bit ({quant.format}) checkpoint; quantization='fp8' would need "
                         "its bfloat16 weights: use quantization='auto'")
    read_gguf = gguf is not None and load_format != "dummy"
    if read_gguf:
        from engine.models.gguf_weights import Q4_0_GROUP, load_gguf_weights, q4_0_projections  # NOTE: imports gguf
    int4_group = quant.group_size if quant.is_int4 else None
    if read_gguf and quantization != "fp8" and q4_0_projections(gguf):
        int4_group = Q4_0_GROUP
    if int4_group is not None:
        convert_to_int4(model, int4_group, int4_path(device, dtype))
    elif quantization == "fp8" or quant.is_fp8:
        convert_to_fp8(model, fp8_path(device, dtype))
    if read_gguf:
        load_gguf_weights(model, gguf, dtype, device)
    elif files:
        load_weights(model, model_dir, dtype, device, quant)
    else:
        init_dummy_weights(model, seed)
    model.eval()
    model.use_fused_ops(fused_ops and device.type == "cuda" and HAS_TRITON)
    return model, arch
