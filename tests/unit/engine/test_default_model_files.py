"""The embedded default model (engine/models/default): files present, small, and consistent:
config.json matches the safetensors' names and shapes, and transformers loads it cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DIR = REPO_ROOT / "engine" / "models" / "default"
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
MAX_TOTAL_BYTES = 4_000_000


def _config() -> dict:
    return json.loads((DEFAULT_DIR / "config.json").read_text())


def _expected_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def test_files_exist_and_are_small() -> None:
    for name in FILES:
        assert (DEFAULT_DIR / name).is_file(), f"missing {DEFAULT_DIR / name}; run bench/make_default_model.py"
    total = sum(p.stat().st_size for p in DEFAULT_DIR.rglob("*") if p.is_file())
    assert total < MAX_TOTAL_BYTES, f"{DEFAULT_DIR} holds {total} bytes, over the {MAX_TOTAL_BYTES} budget"


def test_config_matches_weights() -> None:
    c = _config()
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["torch_dtype"] == "float32"
    assert c["num_attention_heads"] % c["num_key_value_heads"] == 0
    with safe_open(str(DEFAULT_DIR / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert shapes == _expected_shapes(c)
    assert dtypes == {"F32"}


def test_config_matches_tokenizer() -> None:
    c = _config()
    tokenizer = json.loads((DEFAULT_DIR / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert c["vocab_size"] == len(vocab | added) == 2048
    assert added["<|begin_of_text|>"] == c["bos_token_id"]
    assert added["<|end_of_text|>"] == c["eos_token_id"]
    assert set(added) == {"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"}


def test_transformers_loads_it_without_missing_or_unexpected_keys() -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_DIR, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_DIR)
    assert len(hf_tokenizer) == _config()["vocab_size"]
