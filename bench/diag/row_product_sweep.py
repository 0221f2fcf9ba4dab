"""One row through a bfloat16 projection: cuBLAS (F.linear) against engine/models/row_kernels.row_product over a
few tiles, at Llama-3.1-8B's projections for TP=1 and TP=2 (a rank's shard), Llama-3.1-70B's for TP=2, and their
LM heads; the floor beside (weight bytes / copy bandwidth). Timing as bench.diag.fp8_split_k_sweep: weights cycled past L2, one CUDA graph a cycle, median
of its replays.

    python -m bench.diag.row_product_sweep --out DIR
    python -m bench.diag.row_product_sweep --plot RESULT.json   # its PNG again (no GPU)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import save_plot

SHAPES = {  # (N, K)
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
    "8b_tp2_qkv": (3072, 4096), "8b_tp2_o": (4096, 2048), "8b_tp2_gate_up": (14336, 4096), "8b_tp2_down": (4096, 7168),
    "70b_tp2_qkv": (5120, 8192), "70b_tp2_o": (8192, 4096), "70b_tp2_gate_up": (28672, 8192),
    "70b_tp2_down": (8192, 14336), "8b_lm_head": (128256, 4096), "8b_tp2_lm_head": (64128, 4096),
    "70b_tp2_lm_head": (64128, 8192),
}
CONFIGS = [(8, 256, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 256, 4, 3), (16, 512, 4, 3), (8, 512, 4, 4),
           (16, 512, 8, 3)]


def plot(result: Path) -> None:
    """result's PNG beside it: per shape, cuBLAS, the served tile and the best tile over the floor."""
    record = json.loads(result.read_text())
    rows = record["rows"]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        xs = range(len(rows))
        for i, (label, key) in enumerate([("cuBLAS", "cublas_us"), ("row_product (served tile)", "served_us")]):
            ax.bar([x + 0.27 * (i - 1) for x in xs], [r[key] / r["floor_us"] for r in rows], 0.27, label=label)
        ax.bar([x + 0.27 for x in xs], [r["best"]["us"] / r["floor_us"] for r in rows], 0.27, label="best tile")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(xs), [r["shape"] for r in rows], fontsize=8)
        ax.set_ylabel("time over the weights' floor (copy bandwidth)")
        ax.legend(fontsize=8)

    save_plot(result.with_suffix(".png"), draw, f"One row through a bfloat16 projection\n{record['device_name']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--plot", type=Path, default=None, help="Only draw this result's PNG again.")
    args = parser.parse_args()
    if args.plot is not None:
        plot(args.plot)
        return
    # NOTE: imported here: they import Triton's kernels compiled, which an interpreted kernel test collected after
    # an import of this module's plot would then call (tests/interpreted.py)
    from bench.diag.fp8_split_k_sweep import CYCLE_BYTES, per_call_us, write_sweep
    from bench.offline_throughput import copy_bandwidth
    from engine.models import row_kernels

    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, -(-CYCLE_BYTES // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ weights[0].double().t()
        row = {"shape": name, "n": n, "k": k, "floor_us": 1e6 * 2 * n * k / bandwidth,
               "cublas_us": per_call_us(lambda i: F.linear(x, weights[i]), copies), "configs": []}
        for config in CONFIGS:
            got = row_kernels.row_product(x, weights[0], None, config)
            row["configs"].append({
                "config": config, "us": per_call_us(lambda i, c=config: row_kernels.row_product(x, weights[i], None, c),
                                                    copies),
                "max_abs_vs_float64": float((got.double() - want).abs().max())})
        best = min(row["configs"], key=lambda r: r["us"])
        served = next(r for r in row["configs"] if tuple(r["config"]) == row_kernels.row_config(k))
        row["best"], row["served_us"] = best, served["us"]
        print(f"{name}: floor {row['floor_us']:.1f} cuBLAS {row['cublas_us']:.1f} row_product {served['us']:.1f} "
              f"(best {best['us']:.1f} {best['config']})", flush=True)
        rows.append(row)
        weights.clear()
        torch.cuda.empty_cache()
    write_sweep(args.out, "row_product_sweep", bandwidth, rows)
    plot(next(args.out.glob("row_product_sweep_*.json")))


if __name__ == "__main__":
    main()
