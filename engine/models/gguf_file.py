"""Finds a GGUF checkpoint and reads its architecture (an ArchConfig) from the GGUF metadata.

Knows llama.cpp's metadata keys for the `llama` (Llama 2/3, Mistral), `qwen2` and `qwen3`
architectures; knows nothing of tensor data (gguf_weights.py) or of the tokenizer
(gguf_tokenizer.py). Features the engine does not implement are refused here, before any weight
is read: rope scaling other than none/linear (including llama3's `rope_freqs.weight`), partial
rotary embeddings, and split (multi-file) GGUFs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from engine.models.arch import ArchConfig, RopeConfig

GGUF_SUFFIX = ".gguf"

GGUF_ARCHITECTURES: dict[str, str] = {
    # general.architecture -> the engine's architecture name (arch.SUPPORTED_ARCHITECTURES)
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Tensors whose presence means a feature the engine does not implement from GGUF.
_REFUSED_TENSORS: dict[str, str] = {
    "rope_freqs.weight": "llama3-style rope scaling (per-frequency factors in rope_freqs.weight)",
}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself if it ends in .gguf, or the one *.gguf of a directory that
    holds no *.safetensors; None for an HF checkpoint directory."""
    path = Path(path)
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(files) > 1:
        raise ValueError(
            f"the model directory {str(path)!r} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            "name one file as the model (split GGUFs must be merged first with llama.cpp's gguf-split --merge)"
        )
    return files[0] if files else None


class GGUFMetadata:
    """The key/value metadata of one GGUF file, read lazily; errors name the file and the key."""

    def __init__(self, reader: Any, source: str) -> None:  # a gguf.GGUFReader
        self.reader = reader
        self.source = source

    @classmethod
    def open(cls, path: Path) -> GGUFMetadata:
        from gguf import GGUFReader  # NOTE: here, not at import: only a GGUF checkpoint needs the package

        try:
            reader = GGUFReader(path, "r")
        except (ValueError, OSError) as e:  # bad magic, an unknown tensor type id, a truncated file
            raise ValueError(f"{path} is not a GGUF file the gguf package can read: {e}") from e
        return cls(reader, str(path))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source}: GGUF metadata key {key!r} is missing; the engine needs it")
        return value

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def _rope_config(meta: GGUFMetadata, arch: str, head_dim: int) -> RopeConfig:
    dims = meta.get(f"{arch}.rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        raise ValueError(
            f"{meta.source}: {arch}.rope.dimension_count is {dims} but the head size is {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return RopeConfig(theta=theta)
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(meta.require(f"{arch}.rope.scaling.factor")))
    raise ValueError(
        f"{meta.source}: {arch}.rope.scaling.type {scaling!r} is not supported from GGUF; supported: none, linear"
    )


def _eos_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    # eot/eom end a turn in chat models (llama 3's <|eot_id|>): generation stops there as at eos.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(v) for v in (meta.get(k) for k in keys) if v is not None]
    return tuple(dict.fromkeys(ids))


def arch_from_gguf(meta: GGUFMetadata) -> ArchConfig:
    arch = meta.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{meta.source}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    names = meta.tensor_names
    for tensor, feature in _REFUSED_TENSORS.items():
        if tensor in names:
            raise ValueError(f"{meta.source}: {feature} is not supported from GGUF; the model would load wrong")
    hidden = int(meta.require(f"{arch}.embedding_length"))
    num_heads = int(meta.require(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    tokens = meta.reader.get_field("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"{meta.source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocab size")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ArchConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rope=_rope_config(meta, arch, head_dim),
        tie_word_embeddings="output.weight" not in names,
        # Llama biases are optional (attention_bias); the file's tensors say which exist.
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm=arch == "qwen3",
        sliding_window=None,  # llama.cpp's converter writes no window for these architectures
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=_eos_ids(meta),
    )
