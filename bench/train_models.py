"""Trains a real target/draft pair for speculative decoding, offline: a small Llama on the Python
standard library's source, and a several times smaller draft distilled from it.

1. Corpus: the running interpreter's stdlib .py files (sorted; site-packages excluded), split by
   a hash of each file's relative path into train (95%) and held-out (5%); a bounded corpus takes
   files in hash order, a uniform sample of the stdlib. Deterministic for a given interpreter.
2. Tokenizer: byte-level BPE trained by `tokenizers` on the train split, with the special tokens
   (ids 0-3) and chat template of bench/make_default_model.py; documents open with BOS and are
   packed into one stream (no EOS: a model that learned to stop would end requests early).
3. Target: next-token cross-entropy, AdamW, warm-up then cosine decay, bf16 autocast on the GPU.
4. Draft: KL(target || draft) over the target's full next-token distribution, temperature 1.
5. Held-out: loss and perplexity of both; the draft's greedy agreement with the target and its
   expected acceptance at temperature 1 (mean of sum_v min(p_target, p_draft)), token-level.

Each training stops at its step bound or at its share of --minutes, whichever comes first; the
learning-rate schedule follows whichever is nearer, so a run cut by time still decays fully.
Output: OUT/target and OUT/draft (HF checkpoint directories: config.json, model.safetensors with
transformers' names and [out, in] shapes, tokenizer.json, tokenizer_config.json,
generation_config.json) and OUT/summary.json.

Sizes (vocab, target / draft parameters):
- cpu-tiny: 512, 0.15M / 0.04M; seconds. For the test.
- cpu-small: 2048 (the embedded default's vocabulary size), 1.3M / 0.36M, seq 128, batch 8; the
  7-minute default bound binds. Measured on 2 CPU cores shared with other work (load average
  ~15, --num-threads 1): target 2.4k tokens/s, 565 steps (0.58M tokens); held-out loss 4.17
  (perplexity 65), draft 4.28 (72); greedy agreement 0.76. Too little training for sensible
  greedy text: it loops on Python-looking fragments. (2.4M params ran at ~0.5k tokens/s there.)
- cpu-wide: 2048, 2.2M / 0.1M (hidden 256, MLP 512: every width a multiple of 256, as the K-quants
  need), seq 128, batch 8, 8 minutes: the checkpoint bench.quant_quality's gguf-q4k variant can score
  on a CPU.
- default: the embedded default model's shape and tokenizer (2048, 0.89M), seq 256, batch 128,
  up to 8,000 steps in 7 minutes on one GPU, on the stdlib and the installed packages' sources
  (64 MB; the stdlib alone, ~3.5M tokens, is learned by heart: train loss 1.5, held-out 3.0); the draft is a token gesture (200 steps). Its target's
  model.safetensors is engine/models/default's.
- gpu: 8192, ~99M / 6.6M, seq 512, batch 64 (32k tokens a step), on the stdlib and the installed
  packages' sources (64 MB, as default: the stdlib alone is learned by heart), in 5 minutes on one
  GPU: the time bound binds (a target step costs ~6 x 98M FLOP a token, ~20 TFLOP a step). The
  target is ~15x the draft so that it is clearly the better model (the earlier 34M target, cut at
  250 steps, scored perplexity 44.5 against its draft's 44.0); the draft is distilled by KL from it.

    .venv/bin/python -m bench.train_models --out DIR [--size cpu-tiny|cpu-small|gpu] [--device auto] [--minutes N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from bench.make_default_model import BOS, CHAT_TEMPLATE, EOS, IM_END, SPECIAL_TOKENS, train_bpe, write_json
from bench.train_llama import (
    ModelShape,
    TrainConfig,
    TrainLlama,
    TrainResult,
    Windows,
    distillation_loss,
    next_token_loss,
    run_training,
)

HELD_OUT_PERCENT = 5
MAX_POSITIONS = 2048
SAMPLE_PROMPTS = ("def main():\n", "import os\n", "class Stack:\n")


@dataclass(frozen=True)
class SizePlan:
    vocab_size: int
    max_corpus_bytes: int  # train split, UTF-8
    max_tokenizer_bytes: int  # BPE training text, a prefix of the train split
    max_eval_tokens: int  # held-out tokens scored
    seq_len: int
    batch_size: int
    target: ModelShape
    draft: ModelShape
    max_target_steps: int
    max_draft_steps: int
    target_lr: float
    draft_lr: float
    minutes: float  # default wall-clock bound of the whole run
    num_sample_tokens: int
    site_packages: bool = False  # the corpus takes the installed packages' sources too, after the stdlib's


SIZES: dict[str, SizePlan] = {
    "cpu-tiny": SizePlan(
        vocab_size=512, max_corpus_bytes=200_000, max_tokenizer_bytes=200_000, max_eval_tokens=520,
        seq_len=64, batch_size=8, target=ModelShape(64, 160, 2, 4, 2, 16), draft=ModelShape(32, 64, 1, 2, 1, 16),
        max_target_steps=20, max_draft_steps=15, target_lr=3e-3, draft_lr=3e-3, minutes=0.5, num_sample_tokens=8,
    ),
    "cpu-small": SizePlan(
        vocab_size=2048, max_corpus_bytes=8_000_000, max_tokenizer_bytes=3_000_000, max_eval_tokens=16_384,
        seq_len=128, batch_size=8, target=ModelShape(128, 384, 4, 4, 2, 32), draft=ModelShape(64, 192, 2, 2, 1, 32),
        max_target_steps=2_000, max_draft_steps=1_000, target_lr=3e-3, draft_lr=3e-3, minutes=7.0, num_sample_tokens=48,
    ),
    # Rows of whole 256-value super-blocks (every width a multiple of 256): what the K-quants need
    # (bench.quant_quality's gguf-q4k variant), at a size this CPU trains in minutes.
    "cpu-wide": SizePlan(
        vocab_size=2048, max_corpus_bytes=8_000_000, max_tokenizer_bytes=3_000_000, max_eval_tokens=16_384,
        seq_len=128, batch_size=8, target=ModelShape(256, 512, 2, 4, 2, 64), draft=ModelShape(64, 192, 1, 2, 1, 32),
        max_target_steps=3_000, max_draft_steps=100, target_lr=3e-3, draft_lr=3e-3, minutes=8.0, num_sample_tokens=48,
    ),
    # The embedded default model's shape (engine/models/default/config.json), trained with its own
    # tokenizer (--tokenizer engine/models/default): the recipe of the weights it ships.
    "default": SizePlan(
        vocab_size=2048, max_corpus_bytes=64_000_000, max_tokenizer_bytes=1, max_eval_tokens=262_144,
        seq_len=256, batch_size=128, target=ModelShape(128, 352, 2, 4, 2, 32), draft=ModelShape(64, 192, 1, 2, 1, 32),
        max_target_steps=8_000, max_draft_steps=200, target_lr=3e-3, draft_lr=3e-3, minutes=7.0, num_sample_tokens=64,
        site_packages=True,
    ),
    "gpu": SizePlan(
        vocab_size=8192, max_corpus_bytes=64_000_000, max_tokenizer_bytes=8_000_000, max_eval_tokens=262_144,
        seq_len=512, batch_size=64, target=ModelShape(768, 2048, 12, 12, 4, 64),
        draft=ModelShape(256, 768, 3, 4, 2, 64),
        max_target_steps=6_000, max_draft_steps=3_000, target_lr=6e-4, draft_lr=2e-3, minutes=5.0, num_sample_tokens=64,
        site_packages=True,
    ),
}
TARGET_SHARE = 0.65  # of the training time left after the tokenizer; the draft gets the rest
# kept for evaluation and saving
EVAL_RESERVE_S = {"cpu-tiny": 5.0, "cpu-small": 30.0, "cpu-wide": 30.0, "default": 30.0, "gpu": 30.0}


# ---- corpus and tokenizer
def stdlib_files() -> tuple[Path, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in stdlib.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts)
    )
    if not paths:
        raise RuntimeError(f"no .py files under the stdlib directory {stdlib}")
    return stdlib, paths


def corpus_files(site_packages: bool) -> list[tuple[str, Path]]:
    """(name for the split's hash, path): the stdlib's files, then the installed packages' when asked."""
    stdlib, paths = stdlib_files()
    files = [(p.relative_to(stdlib).as_posix(), p) for p in paths]
    if site_packages:
        purelib = Path(sysconfig.get_paths()["purelib"])
        files += [("site/" + p.relative_to(purelib).as_posix(), p) for p in sorted(purelib.rglob("*.py"))]
    return files


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")


def split_corpus(max_train_bytes: int, max_held_out_bytes: int,
                 site_packages: bool = False) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts): files by path hash, each split bounded in UTF-8 bytes."""
    keyed = sorted((_path_hash(name), p) for name, p in corpus_files(site_packages))  # hash order: a uniform sample
    splits: tuple[list[str], list[str]] = ([], [])
    num_bytes = [0, 0]
    for key, path in keyed:
        which = int(key % 100 < HELD_OUT_PERCENT)
        limit = (max_train_bytes, max_held_out_bytes)[which]
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if num_bytes[which] + size <= limit:
            splits[which].append(text)
            num_bytes[which] += size
    if not splits[0] or not splits[1]:
        raise RuntimeError(f"corpus split left a side empty (train {num_bytes[0]} B, held-out {num_bytes[1]} B)")
    return splits


def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int) -> Tokenizer:
    """Byte-level BPE as bench/make_default_model.py builds it: special tokens at ids 0-3, BOS prepended."""
    chosen, num_bytes = [], 0
    for text in texts:
        num_bytes += len(text.encode("utf-8"))
        if num_bytes > max_bytes and chosen:
            break
        chosen.append(text)
    tokenizer = train_bpe(chosen, vocab_size)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), ids
    return tokenizer


def pack(tokenizer: Tokenizer, texts: list[str], max_tokens: int | None = None) -> torch.Tensor:
    """One stream of token ids [tokens]: each document opened by BOS (the tokenizer's own)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        if max_tokens is not None and len(ids) >= max_tokens:
            return torch.tensor(ids[:max_tokens], dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long)


# ---- evaluation
def held_out_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:  # [windows, seq_len + 1]
    num = stream.numel() // (seq_len + 1)
    if num == 0:
        raise ValueError(f"held-out stream has {stream.numel()} tokens; one window needs {seq_len + 1}")
    return stream[: num * (seq_len + 1)].view(num, seq_len + 1)


@torch.no_grad()
def evaluate(target: TrainLlama, draft: TrainLlama, windows: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Token-level held-out figures of both models and of the pair."""
    sums = {"target_nll": 0.0, "draft_nll": 0.0, "agree": 0.0, "accept": 0.0, "kl": 0.0}
    num_tokens = 0
    for batch in windows.split(16):
        batch = batch.to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:].flatten()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            t_logp = F.log_softmax(target(inputs).float(), -1).flatten(0, 1)  # [tokens, vocab]
            d_logp = F.log_softmax(draft(inputs).float(), -1).flatten(0, 1)
        sums["target_nll"] += float(F.nll_loss(t_logp, labels, reduction="sum"))
        sums["draft_nll"] += float(F.nll_loss(d_logp, labels, reduction="sum"))
        sums["agree"] += float((t_logp.argmax(-1) == d_logp.argmax(-1)).sum())
        sums["accept"] += float(torch.minimum(t_logp.exp(), d_logp.exp()).sum())
        sums["kl"] += float(F.kl_div(d_logp, t_logp, log_target=True, reduction="sum"))
        num_tokens += labels.numel()
    mean = {k: v / num_tokens for k, v in sums.items()}
    return {
        "num_tokens": num_tokens,
        "target": {"loss": mean["target_nll"], "perplexity": math.exp(mean["target_nll"])},
        "draft": {"loss": mean["draft_nll"], "perplexity": math.exp(mean["draft_nll"])},
        "draft_greedy_agreement": mean["agree"],
        "draft_expected_acceptance_t1": mean["accept"],
        "kl_target_draft": mean["kl"],
    }


@torch.no_grad()
def greedy(model: TrainLlama, tokenizer: Tokenizer, prompt: str, num_tokens: int, device: torch.device) -> str:
    """Greedy continuation by full recomputation (no KV cache: the model is small)."""
    ids = tokenizer.encode(prompt).ids
    prompt_len = len(ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids], device=device))[0, -1]
        ids.append(int(logits.argmax()))
    return tokenizer.decode(ids[prompt_len:])


# ---- output
def save_checkpoint(out: Path, model: TrainLlama, tokenizer: Tokenizer) -> int:
    """An HF checkpoint directory; returns its size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    bos, eos, im_end = (tokenizer.token_to_id(t) for t in (BOS, EOS, IM_END))
    config = model.shape.hf_config(tokenizer.get_vocab_size(), bos, eos, MAX_POSITIONS)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, im_end], "do_sample": False})
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    tokenizer.save(str(out / "tokenizer.json"))
    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def load_checkpoint(model_dir: Path) -> TrainLlama:
    """The TrainLlama a `save_checkpoint` directory holds, in eval mode, on the CPU."""
    c = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape(
        c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
        c["num_key_value_heads"], c["head_dim"],
    )
    model = TrainLlama(shape, c["vocab_size"], seed=0)
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    return model.eval()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def plan_with_overrides(plan: SizePlan, overrides: Sequence[str]) -> SizePlan:
    numbers = {f.name: f.type for f in fields(SizePlan) if f.type in ("int", "float")}
    changes: dict[str, int | float] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in numbers:
            raise ValueError(f"--set {item!r}: {key!r} is not a number of the plan; known: {', '.join(numbers)}")
        try:
            changes[key] = int(value) if numbers[key] == "int" else float(value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a valid {numbers[key]}") from None
        if changes[key] <= 0:
            raise ValueError(f"--set {item!r}: {key} must be positive")
    return replace(plan, **changes)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Folder for target/, draft/ and summary.json.")
    parser.add_argument("--size", default="cpu-small", choices=list(SIZES))
    parser.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu', or 'cuda[:N]'.")
    parser.add_argument(
        "--minutes", type=float, default=None, help="Wall-clock bound of the whole run (default: the size's)."
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default: the size's).")
    parser.add_argument(
        "--tokenizer", type=Path, default=None,
        help="A checkpoint directory whose tokenizer.json to train with, instead of training a BPE "
             "(--vocab-size unused).",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="Override a number of the size's plan (SizePlan), e.g. --set max_target_steps=4000; repeatable.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's own).")
    parser.add_argument("--quiet", action="store_true", help="No progress lines.")
    args = parser.parse_args(argv)
    try:
        args.plan = plan_with_overrides(SIZES[args.size], args.set)
    except ValueError as e:
        parser.error(str(e))
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    if args.vocab_size is not None and args.vocab_size < 300:
        parser.error(f"--vocab-size must be at least 300 (256 bytes, 4 special tokens, merges), got {args.vocab_size}")
    return args


@dataclass(frozen=True)
class Corpus:
    tokenizer: Tokenizer
    train_stream: torch.Tensor  # [tokens]
    eval_windows: torch.Tensor  # [windows, seq_len + 1]
    num_train_files: int
    num_held_out_files: int
    held_out_text: str  # the held-out files, concatenated: prompts for bench.spec_decode --text


def prepare_corpus(plan: SizePlan, vocab_size: int, tokenizer_dir: Path | None = None) -> Corpus:
    train_texts, held_texts = split_corpus(plan.max_corpus_bytes, plan.max_eval_tokens * 8, plan.site_packages)
    if tokenizer_dir is not None:
        tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(train_texts, vocab_size, plan.max_tokenizer_bytes)
    eval_windows = held_out_windows(pack(tokenizer, held_texts, plan.max_eval_tokens), plan.seq_len)
    return Corpus(tokenizer, pack(tokenizer, train_texts), eval_windows, len(train_texts), len(held_texts),
                  "\n".join(held_texts))


def train_pair(
    plan: SizePlan, corpus: Corpus, deadline: float, device: torch.device, seed: int, log: Callable[[str], None]
) -> dict[str, tuple[TrainLlama, TrainConfig, TrainResult]]:
    """The target by next-token loss, then the draft by distillation; both done by `deadline`."""
    vocab = corpus.tokenizer.get_vocab_size()
    target = TrainLlama(plan.target, vocab, seed=seed).to(device)
    draft = TrainLlama(plan.draft, vocab, seed=seed + 1).to(device)
    train_s = max(deadline - time.perf_counter(), 1.0)
    log(f"target {target.num_params / 1e6:.2f}M params, draft {draft.num_params / 1e6:.2f}M; {train_s:.0f}s to train")

    def config(max_steps: int, lr: float, seconds: float) -> TrainConfig:
        return TrainConfig(max_steps, seconds, plan.batch_size, plan.seq_len, lr)

    target_cfg = config(plan.max_target_steps, plan.target_lr, TARGET_SHARE * train_s)
    windows = Windows(corpus.train_stream, plan.seq_len, seed, device)
    target_run = run_training(target, next_token_loss(target), windows, target_cfg, device, "target", log)
    target.requires_grad_(False)
    draft_cfg = config(plan.max_draft_steps, plan.draft_lr, max(deadline - time.perf_counter(), 1.0))
    windows = Windows(corpus.train_stream, plan.seq_len, seed + 1, device)
    draft_run = run_training(draft, distillation_loss(draft, target), windows, draft_cfg, device, "draft", log)
    return {"target": (target, target_cfg, target_run), "draft": (draft, draft_cfg, draft_run)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    plan: SizePlan = args.plan
    deadline = start + 60.0 * (args.minutes or plan.minutes) - EVAL_RESERVE_S[args.size]
    device = resolve_device(args.device)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def log(line: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f}s] {line}", flush=True)

    corpus = prepare_corpus(plan, args.vocab_size or plan.vocab_size, args.tokenizer)
    prepare_s = time.perf_counter() - start
    log(f"corpus: {corpus.num_train_files} train files ({corpus.train_stream.numel()} tokens), "
        f"{corpus.num_held_out_files} held-out; vocab {corpus.tokenizer.get_vocab_size()}")
    torch.manual_seed(args.seed)
    trained = train_pair(plan, corpus, deadline, device, args.seed, log)
    target, draft = trained["target"][0], trained["draft"][0]

    held_out = evaluate(target, draft, corpus.eval_windows, device)
    samples = {
        name: {p: greedy(model, corpus.tokenizer, p, plan.num_sample_tokens, device) for p in SAMPLE_PROMPTS}
        for name, (model, _, _) in trained.items()
    }
    records: dict[str, Any] = {}
    for name, (model, cfg, run) in trained.items():
        records[name] = {
            "shape": asdict(model.shape),
            "num_params": model.num_params,
            "dir": str(args.out / name),
            "dir_bytes": save_checkpoint(args.out / name, model, corpus.tokenizer),
            "train": {**asdict(run), "tokens_per_s": run.tokens_per_s},
            "config": asdict(cfg),
        }
    summary = {
        "size": args.size,
        "plan_overrides": args.set,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "num_cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "seed": args.seed,
        "corpus": {
            "source": "the running interpreter's stdlib .py files"
                      + (" and its installed packages'" if plan.site_packages else ""),
            "held_out_percent": HELD_OUT_PERCENT,
            "num_train_files": corpus.num_train_files,
            "num_held_out_files": corpus.num_held_out_files,
            "num_train_tokens": corpus.train_stream.numel(),
            "vocab_size": corpus.tokenizer.get_vocab_size(),
        },
        **records,
        "held_out": held_out,
        "samples_greedy": samples,
        "seconds": {"prepare": prepare_s, "total": time.perf_counter() - start},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    (args.out / "held_out.txt").write_text(corpus.held_out_text)
    t, d = held_out["target"], held_out["draft"]
    log(f"held-out: target loss {t['loss']:.3f} (ppl {t['perplexity']:.1f}), draft {d['loss']:.3f} "
        f"(ppl {d['perplexity']:.1f}), greedy agreement {held_out['draft_greedy_agreement']:.3f}, "
        f"expected acceptance {held_out['draft_expected_acceptance_t1']:.3f}; total {summary['seconds']['total']:.0f}s")
    return summary


if __name__ == "__main__":
    main()
