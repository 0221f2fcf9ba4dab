"""Converts an HF checkpoint (the tests' small ones, bench/train_models.py's) to a GGUF file the way
llama.cpp's convert_hf_to_gguf.py does: its metadata keys, its tensor names, Q/K rows permuted for
`llama`, 1-D tensors kept in F32, and the byte-level BPE vocabulary in tokenizer.ggml.* keys. 2-D
tensors in one type: those the `gguf` package quantizes, or Q4_K (bench/k_quants.py; a tensor whose
rows are not a multiple of 256 values then stays Q8_0, as llama.cpp falls back).

`edit` hooks let error tests write a broken file: drop or replace a tensor, change a key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, TokenType
from safetensors.numpy import load_file

from bench.k_quants import QK_K, quantize_q4_k

_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3"}
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_tensor_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[part]}.{kind}"


def gguf_tensors(hf_dir: Path, config: dict) -> dict[str, np.ndarray]:
    arch = _GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    for name, value in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        value = value.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            value = permute(value, heads, heads)
        elif arch == "llama" and ".k_proj." in name:
            value = permute(value, heads, kv_heads)
        out[gguf_tensor_name(name)] = value
    return out


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == config["vocab_size"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)  # the default tokenizer's post-processor prepends BOS
    writer.add_chat_template(tok_config["chat_template"])


def write_gguf(
    hf_dir: Path, out: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None, architecture: str | None = None,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """qtype: the type of every 2-D tensor (1-D tensors stay F32, as in llama.cpp). raw: tensors (by
    GGUF name) written as the given bytes of the given type instead (types gguf cannot quantize)."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = architecture or _GGUF_ARCH[config["architectures"][0]]
    tensors = gguf_tensors(hf_dir, config)
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":  # llama.cpp writes the factors as a tensor
        tensors["rope_freqs.weight"] = np.ones(config["head_dim"] // 2, dtype=np.float32)
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(scaling.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(int(qtype))
    _write_tokenizer(writer, hf_dir, config)
    for name, value in tensors.items():
        if raw is not None and name in raw:
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif value.ndim == 2 and qtype == GGMLQuantizationType.Q4_K and value.shape[1] % QK_K == 0:
            writer.add_tensor(name, quantize_q4_k(value), raw_dtype=qtype)
        elif value.ndim == 2 and qtype == GGMLQuantizationType.Q4_K:
            writer.add_tensor(name, gguf.quants.quantize(value, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        elif value.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
