"""Held-out perplexity through the engine's own model, bfloat16 against each quantization, side by
side in one run: the checkpoint bench/train_models.py trains (OUT/target) scored on the held-out
text it wrote (OUT/held_out.txt, files the training never saw), in windows of --seq-len tokens,
each window one prefill through LlamaForCausalLM with the engine's attention backend and KV cache.

    python -m bench.quant_quality --checkpoint OUT/target --held-out OUT/held_out.txt
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from tokenizers import Tokenizer

from bench.gguf_write import write_gguf
from bench.int4_rtn import write_int4_rtn
from bench.common import base_parser, device_name, model_label, write_results
from bench.train_models import held_out_windows, pack
from engine import LLM
from engine.attention import AttentionMetadata

VARIANTS = {"bfloat16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv": {"kv_cache_dtype": "fp8"},
            "fp8+fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}, "w4a16-rtn": {}, "gguf-q4k": {}}
"""w4a16-rtn: the checkpoint written in AutoAWQ's format by round-to-nearest, --group columns a scale
(bench/int4_rtn.py). gguf-q4k: the checkpoint as a GGUF file whose every 2-D tensor is Q4_K
(bench/gguf_write.py, bench/k_quants.py; the engine dequantizes it at load); its widths must be
multiples of 256 (bench.train_models --size cpu-wide or gpu)."""


@torch.inference_mode()
def window_nll(llm: LLM, window: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of window[1:] given window[:-1], one prefill into
    blocks 0.. of the (idle) engine's cache."""
    runner = llm.engine.runner
    device, block_size = runner.device, runner.block_size
    ids = window[:-1].to(device)
    n = ids.numel()
    blocks = list(range(-(-n // block_size)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), query_start_loc=[0, n], seq_lens=[n], block_tables=[blocks],
        block_tables_tensor=torch.tensor([blocks], dtype=torch.int32, device=device),
        seq_lens_tensor=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc_tensor=torch.tensor([0, n], dtype=torch.int32, device=device), max_query_len=n, max_seq_len=n,
    )
    hidden = runner.model(ids, torch.arange(n, device=device), runner.kv_caches, meta, runner.backend)
    logits = runner.model.compute_logits(hidden)
    return float(F.cross_entropy(logits, window[1:].to(device), reduction="sum"))


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--held-out", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=262_144)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--group", type=int, default=128, help="w4a16-rtn's input columns a scale")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    windows = held_out_windows(pack(tokenizer, [args.held_out.read_text()], args.max_tokens), args.seq_len)
    runs: list[dict[str, Any]] = []
    for variant in args.variants:
        checkpoint = args.checkpoint
        if variant == "w4a16-rtn":
            checkpoint = Path(tempfile.mkdtemp()) / "awq"
            write_int4_rtn(args.checkpoint, checkpoint, args.group)
        elif variant == "gguf-q4k":
            checkpoint = write_gguf(args.checkpoint, Path(tempfile.mkdtemp()) / "model-q4_k.gguf",
                                    GGMLQuantizationType.Q4_K)
        llm = LLM(str(checkpoint), dtype=args.dtype, device=args.device, enforce_eager=True,
                  num_blocks=-(-args.seq_len // 16) + 1, max_model_len=args.seq_len + 1, **VARIANTS[variant])
        nll = sum(window_nll(llm, w) for w in windows)
        tokens = windows.shape[0] * args.seq_len
        runs.append({"variant": variant, "weights": llm.engine.weights, "loss": nll / tokens,
                     "perplexity": math.exp(nll / tokens), "num_tokens": tokens})
        print(f"{variant}: held-out perplexity {runs[-1]['perplexity']:.4f} over {tokens} tokens", flush=True)
        env = {"device": str(llm.engine.device), "device_name": device_name(llm.engine.device),
               "torch_version": torch.__version__, "model": {"name": model_label(args.checkpoint),
                                                             "num_params": llm.engine.arch.num_params}}
        llm.close()
    base = next((r for r in runs if r["variant"] == "bfloat16"), None)
    for r in runs:
        if base is not None:
            r["perplexity_vs_bfloat16"] = r["perplexity"] / base["perplexity"]

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        ax.bar([r["variant"] for r in runs], [r["perplexity"] for r in runs])
        ax.set_ylabel(f"held-out perplexity ({runs[0]['num_tokens']} tokens)")

    write_results(Path(args.out), "quant_quality", env, {"seq_len": args.seq_len, "runs": runs}, plot,
                  f"quant_quality: {env['model']['name']}, {env['device_name']}")


if __name__ == "__main__":
    main()
