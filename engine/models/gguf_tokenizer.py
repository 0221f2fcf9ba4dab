"""Turns a GGUF file into a checkpoint directory the rest of pdserve reads like an HF one.

`checkpoint_dir(path)` materializes, once per GGUF file (keyed by its path, size and mtime), a
cache directory holding:

    model.gguf              a symlink to the GGUF file: build_model loads its weights from there
    config.json             a summary of the ArchConfig for readers of config.json (the router);
                            build_model itself reads the GGUF metadata, never this file
    generation_config.json  the stop ids (eos, eot, eom)
    tokenizer.json          an HF `tokenizers` byte-level BPE built from tokenizer.ggml.* metadata
    tokenizer_config.json   bos/eos tokens and tokenizer.chat_template

Only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) becomes a tokenizer; a sentencepiece
(`llama`) vocabulary is left out, so that the model serves token-id prompts only. Of
`tokenizer.ggml.pre` (the pre-tokenizer's split regex) only the names in PRE_TOKENIZER_REGEXES are
honoured; any other uses GPT-2's regex and may split some text differently from llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.models.arch import ArchConfig
from engine.models.gguf_file import GGUFMetadata, arch_from_gguf, find_gguf

logger = logging.getLogger(__name__)

GGUF_LINK = "model.gguf"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, str | None] = {
    # tokenizer.ggml.pre -> the split regex before byte-level mapping; None: GPT-2's own
    "default": None,
    "gpt-2": None,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values that are added tokens


def default_cache_root() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve"
    )
    return Path(root) / "gguf"


def _pre_tokenizer(pre: str | None) -> dict[str, Any]:
    if pre not in PRE_TOKENIZER_REGEXES:
        logger.warning(
            "GGUF tokenizer.ggml.pre %r is not known to pdserve (known: %s); using GPT-2's split regex, "
            "which may tokenize some text differently from llama.cpp", pre, ", ".join(PRE_TOKENIZER_REGEXES),
        )
    regex = PRE_TOKENIZER_REGEXES.get(pre or "default")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex is None}
    if regex is None:
        return byte_level
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, byte_level]}


def _post_processor(bos: str | None, bos_id: int) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if bos is None:
        return byte_level
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    return {"type": "Sequence", "processors": [byte_level, template]}


def tokenizer_json(meta: GGUFMetadata) -> dict[str, Any]:
    """The HF tokenizers JSON of a `gpt2` (byte-level BPE) GGUF vocabulary."""
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{meta.source}: GGUF tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE); "
            "pass prompts as token ids, or put the model's HF tokenizer.json beside the .gguf file"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges: list[str] = meta.get("tokenizer.ggml.merges", [])
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind != _CONTROL, "special": kind == _CONTROL}
        for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (_CONTROL, _USER_DEFINED)
    ]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    bos = tokens[int(bos_id)] if add_bos and bos_id is not None else None
    post = _post_processor(bos, int(bos_id or 0))
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(meta.get("tokenizer.ggml.pre")),
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ") for m in merges],
        },
    }


def tokenizer_config(meta: GGUFMetadata) -> dict[str, Any]:
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": False,  # NOTE: tokenizer.json's post-processor adds BOS when the GGUF asks
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def hf_config(arch: ArchConfig) -> dict[str, Any]:
    """config.json keys of the ArchConfig, as arch.load_arch reads them."""
    rope: dict[str, Any] = {"rope_theta": arch.rope.theta}
    if arch.rope.rope_type == "linear":
        rope["rope_scaling"] = {"rope_type": "linear", "factor": arch.rope.factor}
    return {
        "architectures": [arch.architecture],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        **rope,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.architecture == "LlamaForCausalLM" and arch.qkv_bias,
        "mlp_bias": arch.mlp_bias,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": list(arch.eos_token_ids),
    }


def _write_dir(gguf: Path, out: Path) -> None:
    meta = GGUFMetadata.open(gguf)
    arch = arch_from_gguf(meta)
    files: dict[str, Any] = {
        "config.json": hf_config(arch),
        "generation_config.json": {"bos_token_id": arch.bos_token_id, "eos_token_id": list(arch.eos_token_ids)},
    }
    if meta.get("tokenizer.ggml.model") == "gpt2":
        files["tokenizer.json"] = tokenizer_json(meta)
        files["tokenizer_config.json"] = tokenizer_config(meta)
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, ensure_ascii=False, indent=1), encoding="utf-8")
    (out / GGUF_LINK).symlink_to(gguf.resolve())


def checkpoint_dir(path: str | Path, cache_root: Path | None = None) -> Path:
    """`path` itself for an HF checkpoint directory (or a GGUF directory that has its own
    tokenizer.json); for a GGUF file, its materialized cache directory (see the module docstring)."""
    path = Path(path)
    gguf = find_gguf(path)
    if gguf is None or (path.is_dir() and (path / "tokenizer.json").is_file()):
        return path
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = (cache_root or default_cache_root()) / f"{gguf.stem}-{key}"
    if (out / GGUF_LINK).is_symlink():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: written whole in a temporary directory, then renamed: a reader (the router, another
    # engine) sees a complete directory or none.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_dir(gguf, staging)
        staging.rename(out)
    except OSError:
        if not (out / GGUF_LINK).is_symlink():
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out
