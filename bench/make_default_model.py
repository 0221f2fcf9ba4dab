"""Build the embedded default model under engine/models/default: a byte-level BPE tokenizer and a
tiny Llama checkpoint with random weights, in the Hugging Face file layout.

The tokenizer is trained on the Python standard library's own source (read from the running
interpreter's stdlib directory: sorted file list, bounded text), so no download is needed. The
weights it writes are random (normal, std 0.02; RMSNorm weights 1); the shipped ones are trained
on top of its tokenizer by `python -m bench.train_models --size default --tokenizer
engine/models/default` (on a GPU), whose target's model.safetensors replaces them.

Deterministic for a given interpreter: the seed is fixed and the training text is sorted.
A different Python version has a different stdlib, hence a different vocabulary.

    .venv/bin/python bench/make_default_model.py [--out engine/models/default]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from bench.train_llama import INIT_STD, ModelShape

REPO_ROOT = Path(__file__).resolve().parents[1]
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_texts(max_bytes: int) -> list[str]:
    """The stdlib's .py files in sorted order (site-packages excluded), up to max_bytes of UTF-8."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in stdlib.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts)
    )
    texts: list[str] = []
    num_bytes = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if num_bytes + size > max_bytes:
            break
        texts.append(text)
        num_bytes += size
    if not texts:
        raise RuntimeError(f"no readable .py files under the stdlib directory {stdlib}")
    return texts


def train_tokenizer(vocab_size: int, max_text_bytes: int) -> Tokenizer:
    """A GPT-2 style byte-level BPE; encode() prepends <|begin_of_text|> like Llama 3."""
    return train_bpe(stdlib_texts(max_text_bytes), vocab_size)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on `texts`: special tokens at ids 0-3, encode() prepends BOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tokenizer


def llama_config(args: argparse.Namespace, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    shape = ModelShape(args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads, args.num_kv_heads,
                       args.head_dim)
    return shape.hf_config(vocab_size, bos_id, eos_id, max_positions=2048)


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF Llama tensor names and [out_features, in_features] shapes, float32."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * INIT_STD

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        weights[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim)
        weights[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return weights


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "engine" / "models" / "default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--max-text-bytes", type=int, default=3_000_000, help="tokenizer training text, UTF-8 bytes")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=352)
    # NOTE: 2 layers, not 4: at vocab 2048 and float32, 4 layers make model.safetensors 5.05 MB,
    # over the 4 MB budget of the embedded files; 2 layers make it 3.57 MB.
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = train_tokenizer(args.vocab_size, args.max_text_bytes)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = llama_config(args, tokenizer.get_vocab_size(), ids[BOS], ids[EOS])

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    write_json(args.out / "config.json", config)
    write_json(
        args.out / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[IM_END]], "do_sample": False},
    )
    write_json(
        args.out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(random_weights(config, args.seed), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {args.out} ({total / 1e6:.2f} MB, vocab {config['vocab_size']})")


if __name__ == "__main__":
    main()
