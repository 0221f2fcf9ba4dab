"""Loads a GGUF file's tensors into a LlamaForCausalLM.

A file whose every decoder projection is Q4_0 loads those onto the 4-bit path (engine/quant/int4.py:
Q4_0's blocks of 32 are d * (q - 8), exactly a 4-bit group with scale d and zero point 8), a
quarter of the float16 bytes. Every other tensor, and every tensor of any other file, of a type
`gguf.quants.dequantize` knows (F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K,
the IQ and TQ types, MXFP4) becomes the model's dtype as it is read, so a Q4_K file takes as much
memory as its float16 original. Knows llama.cpp's tensor names and its Q/K row permutation of
`llama` models; knows nothing of the metadata (gguf_file.py).
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.models.arch import ArchConfig
from engine.models.gguf_file import GGUFMetadata
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import checkpoint_shape, copy_checked, copy_int4
from engine.quant.convert import QUANTIZED_LINEARS

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    # llama.cpp's name inside blk.N -> transformers' name inside model.layers.N
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a llama.cpp tensor name; None for a name outside the map."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a transformers tensor name (for messages)."""
    for gguf, name in _TOP_LEVEL.items():
        if name == hf:
            return gguf
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    for gguf, name in _BLOCK.items():
        if match is not None and match.group(2) == name:
            return f"blk.{match.group(1)}.{gguf}.{match.group(3)}"
    return hf


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` for `llama` q/k weights [heads*head_dim, in] and biases
    [heads*head_dim]: llama.cpp stores each head's rotary pairs as (0, 1), (2, 3), ... where
    transformers keeps the halves (0, d/2), (1, d/2 + 1), ..."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_tensor(meta: GGUFMetadata, index: int) -> np.ndarray:
    """The tensor as float32 in numpy (transformers') axis order: [out, in] for a matrix."""
    tensor = meta.reader.tensors[index]
    try:
        # NOTE: GGUF lists dims innermost first (tensor.shape is [in, out]); tensor.data is already
        # in numpy order, its last axis in bytes for quantized types, which dequantize expands.
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"{meta.source}: tensor {tensor.name} has type {GGMLQuantizationType(tensor.tensor_type).name}, "
            f"which gguf {_gguf_version()} cannot dequantize; re-quantize the model to e.g. Q8_0 or Q4_K"
        ) from e
    return np.array(values, dtype=np.float32)  # a copy: the reader's memory map is read-only


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


_PROJECTIONS = tuple(f"{p}.weight" for p in QUANTIZED_LINEARS)
Q4_0_GROUP = 32


def q4_0_projections(meta: GGUFMetadata) -> bool:
    """True when every decoder projection of the file is Q4_0 (they then load on the 4-bit path)."""
    types = [t.tensor_type for t in meta.reader.tensors if (hf_name(t.name) or "").endswith(_PROJECTIONS)]
    return bool(types) and all(t == GGMLQuantizationType.Q4_0 for t in types)


def read_q4_0(meta: GGUFMetadata, index: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 matrix as (q [out, in] uint8 in [0, 15], d [out, in / 32] float16): value = d * (q - 8).
    A block is d (float16) then 16 bytes: byte j holds element j (low nibble) and j + 16 (high)."""
    data = np.asarray(meta.reader.tensors[index].data)  # [out, in / 32 * 18] bytes
    blocks = data.reshape(data.shape[0], -1, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(data.shape[0], -1)
    return q, d


def _load_q4_0(param: torch.nn.Parameter, meta: GGUFMetadata, index: int, permute_heads: int | None,
               where: str) -> None:
    q, d = read_q4_0(meta, index)
    if permute_heads is not None:
        q, d = unpermute_rows(q, permute_heads), unpermute_rows(d, permute_heads)
    if q.shape != checkpoint_shape(param):
        raise ValueError(f"{where} has shape {q.shape}, the GGUF metadata implies {checkpoint_shape(param)}")
    scales = torch.from_numpy(d.copy()).to(param.device)
    copy_int4(param, torch.from_numpy(q.copy()).to(param.device), scales, torch.full_like(scales, 8.0), Q4_0_GROUP)


def load_gguf_weights(
    model: LlamaForCausalLM, meta: GGUFMetadata, dtype: torch.dtype, device: torch.device
) -> None:
    arch: ArchConfig = model.arch
    params = dict(model.named_parameters())
    is_llama = meta.get("general.architecture") == "llama"
    loaded: set[str] = set()
    for index, tensor in enumerate(meta.reader.tensors):
        name = hf_name(tensor.name)
        if name is None or name not in params:
            raise ValueError(
                f"{meta.source}: tensor {tensor.name} has no place in a {arch.architecture} model; "
                "the file holds a feature the engine does not implement"
            )
        where = f"{meta.source}: tensor {tensor.name} ({name})"
        if params[name].dtype == torch.uint8:  # 4-bit: q4_0_projections held
            heads = (arch.num_heads if name.endswith("q_proj.weight") else arch.num_kv_heads
                     if name.endswith("k_proj.weight") else None)
            _load_q4_0(params[name], meta, index, heads if is_llama else None, where)
            loaded.add(name)
            continue
        values = read_tensor(meta, index)
        if is_llama and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rows(values, arch.num_heads)
        elif is_llama and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rows(values, arch.num_kv_heads)
        copy_checked(params[name], torch.from_numpy(values), where, "the GGUF metadata", dtype, device)
        loaded.add(name)
    tied = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(f"{gguf_name(n)} ({n})" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{meta.source} lacks tensors the model needs: {shown}{more}")
