"""One row through an FP8 projection: split_k_matmul's tensor-core tiles, Fp8Matmul as it stands (the
quantization, then gemv_matmul) and gemv_matmul (CUDA cores, float32 lanes) over a grid of tiles, warps and stages, at
Llama-3.1-8B's projections; the floor beside (weight bytes / copy bandwidth). Timing as
bench.diag.fp8_split_k_sweep: weights cycled past L2, one CUDA graph a cycle, median of its replays.
`--grid` times only the configs named (`_k2048`: steps of 2048 columns, fewer instructions a weight, slower at
every projection).

    python -m bench.diag.fp8_gemv_sweep --out DIR
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import torch

from bench.diag.fp8_split_k_sweep import SHAPES, per_call_us, sweep_configs, weight_copies, write_sweep
from bench.offline_throughput import copy_bandwidth
from engine.quant import fp8_kernels
from engine.quant.fp8 import Fp8Matmul


def first_grid() -> list[fp8_kernels.GemvConfig]:
    """(block_n, block_k, warps, stages 3). The committed sweep also split K in 2, 4 and 8 (configs of five:
    the split third): it lost everywhere but down at 512-column steps, and gemv_matmul lost the split."""
    return [(8, 256, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3),
            (16, 1024, 8, 3), (32, 512, 8, 3), (64, 256, 8, 3)]


def refine(best: fp8_kernels.GemvConfig) -> list[fp8_kernels.GemvConfig]:
    bn, bk, _, _ = best
    return [(bn, bk, w, s) for w, s in itertools.product([4, 8], [2, 3, 4, 5])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["8b_qkv", "8b_o", "8b_gate_up", "8b_down"])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--grid", default="", help="only these configs, no refinement: comma-separated "
                        "block_n:block_k:warps:stages")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    explicit = [tuple(int(v) for v in c.split(":")) for c in args.grid.split(",") if c]
    bandwidth = copy_bandwidth(torch.device("cuda"))
    served = Fp8Matmul("cuda", triton=True)
    counts = fp8_kernels.split_k_counts(torch.device("cuda"))
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        copies = len(weights)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = fp8_kernels.quantize_rows(x)
        want = fp8_kernels.split_k_matmul(xq, xs, *weights[0], None, torch.float32, counts)
        row = {"shape": name, "n": n, "k": k, "floor_us": 1e6 * n * k / bandwidth,
               "split_k_us": per_call_us(lambda i: fp8_kernels.split_k_matmul(xq, xs, *weights[i], None, torch.bfloat16,
                                                                              counts), copies),
               "served_us": per_call_us(lambda i: served(x, *weights[i], None), copies), "configs": []}

        def call_for(c: fp8_kernels.GemvConfig) -> Callable[[int], torch.Tensor]:
            return lambda i: fp8_kernels.gemv_matmul(xq, xs, *weights[i], None, torch.bfloat16, c)

        def check(c: fp8_kernels.GemvConfig) -> float:
            got = fp8_kernels.gemv_matmul(xq, xs, *weights[0], None, torch.float32, c)
            return float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())

        row["configs"] = sweep_configs(explicit or first_grid(), (lambda best: []) if explicit else refine, call_for,
                                       check, "max_rel_vs_split_k", copies)
        best = min(row["configs"], key=lambda r: r["us"])
        row["best_gemv"] = best
        print(f"{name}: floor {row['floor_us']:.1f} split-K {row['split_k_us']:.1f} served {row['served_us']:.1f} "
              f"gemv best {best['us']:.1f} {best['config']} (rel err {best['max_rel_vs_split_k']:.1e})", flush=True)
        rows.append(row)
        weights.clear()
        torch.cuda.empty_cache()
    write_sweep(args.out, f"fp8_gemv_sweep{args.tag}", bandwidth, rows)


if __name__ == "__main__":
    main()
