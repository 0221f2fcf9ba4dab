"""Does a batch-1 decode at a short context gain from not splitting its keys? The pair target's step
(bench.profile_step) spent 44 + 51 us of its ~440 in the split decode and its reduce over 12 layers
at a 256-token context. Here, per shape and context: `layers` decode launches (one per layer, each
layer its own cache, as a step reads them) captured in one CUDA graph and replayed, at num_splits
1, 2, 4 and the engine's plan (`decode_split_plan` for the graphs' max context); the median of 10
replays (bench.common.graph_seconds) over the layer count. On a CPU (TRITON_INTERPRET=1) it only checks that every plan computes the
same output.

    python -m bench.diag.decode_split_short [--max-context 2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_seconds
from engine.attention.triton_backend import TritonAttentionConfig, _cdiv, _num_sms, decode_split_plan

SHAPES = {  # name: (query heads, kv heads, head_dim, layers)
    "pair-target": (12, 4, 64, 12),
    "llama-3.1-8b": (32, 8, 128, 32),
}
BLOCK = 16


def case(name: str, context: int, max_context: int, device: torch.device) -> dict[str, object]:
    from engine.attention import triton_kernels as tk

    heads, kv_heads, dim, layers = SHAPES[name]
    cfg = TritonAttentionConfig()
    num_blocks = -(-context // BLOCK)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    caches = [(torch.randn(num_blocks, BLOCK, kv_heads, dim, device=device, dtype=dtype),
               torch.randn(num_blocks, BLOCK, kv_heads, dim, device=device, dtype=dtype)) for _ in range(layers)]
    q = torch.randn(1, heads, dim, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32)[None]
    seq_lens = torch.tensor([context], device=device, dtype=torch.int32)
    starts = torch.tensor([0, 1], device=device, dtype=torch.int32)
    plan, _ = decode_split_plan(1, kv_heads, max_context, _num_sms(device), cfg)
    out = torch.empty_like(q)
    row: dict[str, object] = {"shape": name, "context": context, "engine_plan_splits": plan}
    reference = None
    for splits in sorted({1, 2, 4, plan}):
        tps = _cdiv(_cdiv(max_context, splits), cfg.decode_block_n) * cfg.decode_block_n
        numel = tk.decode_workspace_numel(1, heads, splits, dim)
        workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=device)

        def step() -> None:
            for k_cache, v_cache in caches:
                tk.decode_attention(q, k_cache, v_cache, out, tables, seq_lens, starts, scale=dim ** -0.5,
                                    sliding_window=None, num_splits=splits, tokens_per_split=tps,
                                    max_splits=cfg.max_splits, block_n=cfg.decode_block_n,
                                    num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
                                    workspace=workspace)

        step()
        if reference is None:
            reference = out.float().clone()
        err = float((out.float() - reference).norm() / reference.norm())
        row[f"rel_err_vs_1_split_{splits}"] = err
        if device.type != "cuda":
            continue
        row[f"us_a_layer_splits_{splits}"] = 1e6 * graph_seconds(step, device, 1) / layers
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-context", type=int, default=2048, help="The graphs' max context (the plan's input).")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [case(name, c, max(args.max_context, c), device) for name in SHAPES for c in args.contexts]
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
