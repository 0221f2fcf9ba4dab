"""Which FP8 product is fastest at each projection shape and batch: Fp8Matmul as it stands (the
Triton quantization, then split_k_matmul with split_k_config's tiles up to SPLIT_K_MAX_ROWS rows,
torch._scaled_mm above), the quantization alone, torch._scaled_mm alone on quantized rows, and the
floor (weight bytes / copy bandwidth); with --grid, split_k_matmul over a grid of tiles and K splits.

Shapes: Llama-3.1-8B's and Llama-3.1-70B's projections at TP=1 (qkv, o, gate_up, down). Each timing
cycles through copies of the weight holding at least 256 MiB together, so no call finds its
weight in L2 (a served step reads every projection once); per call, one CUDA graph of a cycle, the
median of 10 replays. The grid's best is then refined over warps and pipeline stages.

    python -m bench.diag.fp8_split_k_sweep --out DIR [--rows 1 2 4 ...]
    python -m bench.diag.fp8_split_k_sweep --plot RESULT.json [--before EARLIER.json]   (its PNG beside it)
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import device_slug, graph_seconds, save_plot
from bench.offline_throughput import copy_bandwidth
from engine.quant import fp8_kernels
from engine.quant.fp8 import Fp8Matmul, quantize_rows

SHAPES = {
    "8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
    "70b_qkv": (10240, 8192), "70b_o": (8192, 8192), "70b_gate_up": (57344, 8192), "70b_down": (8192, 28672),
}
CYCLE_BYTES = 256 << 20


def per_call_us(fn: Callable[[int], object], copies: int) -> float:
    """Device microseconds a call of fn(copy index), one graph of `copies` calls (each copy once)."""
    calls = iter(itertools.cycle(range(copies)))
    return 1e6 * graph_seconds(lambda: fn(next(calls)), torch.device("cuda"), copies) / copies


def weight_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Quantized random [n, k] weights and their scales, enough copies to hold CYCLE_BYTES together."""
    weights = []
    for _ in range(max(2, -(-CYCLE_BYTES // (n * k)))):
        wq, ws = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        weights.append((wq, ws.view(-1)))
    return weights


def write_sweep(out_dir: Path, stem: str, bandwidth: float, rows: list[dict]) -> None:
    """A sweep's JSON, OUT_DIR/<stem>_<device slug>.json: the device, torch and Triton versions, the copy
    bandwidth and the rows."""
    (out_dir / f"{stem}_{device_slug(torch.device('cuda'))}.json").write_text(json.dumps(
        {"device_name": torch.cuda.get_device_name(), "torch_version": torch.__version__,
         "triton_version": __import__("triton").__version__, "copy_bandwidth_gbs": bandwidth / 1e9,
         "rows": rows}, indent=2) + "\n")


def sweep_configs(first: Sequence[Any], refine_best: Callable[[Any], Sequence[Any]],
                  call_for: Callable[[Any], Callable[[int], object]], check: Callable[[Any], float], error_key: str,
                  copies: int) -> list[dict]:
    """Times every config of `first`, then of refine_best(the fastest so far), each once: per config its
    microseconds a call and check(config) under error_key. A config Triton cannot build (past the
    registers or shared memory) is skipped."""
    rows: list[dict] = []
    tried = set()

    def time_each(configs: Sequence[Any]) -> None:
        for c in configs:
            if c in tried:
                continue
            tried.add(c)
            try:
                error = check(c)
            except Exception as e:  # noqa: BLE001 (a configuration Triton cannot build: skipped)
                print(f"  skipped {c}: {type(e).__name__}", flush=True)
                continue
            rows.append({"config": c, "us": per_call_us(call_for(c), copies), error_key: error})

    time_each(first)
    if rows:
        time_each(refine_best(min(rows, key=lambda r: r["us"])["config"]))
    return rows


def grid(m: int) -> list[fp8_kernels.SplitKConfig]:
    block_m = min(32, max(16, 1 << (m - 1).bit_length()))  # 64: wgmma, inexact FP8 sums
    return [(block_m, bn, bk, split, 4, 4) for bn, bk, split in itertools.product([32, 64, 128], [128, 256],
                                                                                   [1, 2, 4, 8, 16])]


def refine(best: fp8_kernels.SplitKConfig) -> list[fp8_kernels.SplitKConfig]:
    bm, bn, bk, split, _, _ = best
    return [(bm, bn, bk, split, warps, stages) for warps, stages in itertools.product([4, 8], [3, 4, 5, 6])]


def plot(result: Path, before: Path | None) -> None:
    """result's PNG: per shape, time / floor by rows for Fp8Matmul as it stands, quantization +
    torch._scaled_mm, and `before`'s Fp8Matmul (an earlier commit's sweep on the same machine)."""
    now = json.loads(result.read_text())
    then = json.loads(before.read_text()) if before else None

    def draw(fig: object) -> None:
        for i, name in enumerate(SHAPES):
            ax = fig.add_subplot(2, 4, i + 1)
            rows = [r for r in now["rows"] if r["shape"] == name]
            ms = [r["rows"] for r in rows]
            ax.plot(ms, [r["served_us"] / r["floor_us"] for r in rows], "o-", label="Fp8Matmul (split-K to 32 rows)")
            ax.plot(ms, [(r["scaled_mm_us"] + r["quantize_us"]) / r["floor_us"] for r in rows], "s--",
                    label="quantize + torch._scaled_mm")
            if then:
                old = [r for r in then["rows"] if r["shape"] == name]
                ax.plot([r["rows"] for r in old], [r["served_us"] / r["floor_us"] for r in old], "x:",
                        label="Fp8Matmul before (small_matmul to 2 rows)")
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"{name} ({rows[0]['n']}x{rows[0]['k']})", fontsize=9)
            ax.set_xlabel("rows", fontsize=8)
            ax.set_ylabel("time / weight-read floor", fontsize=8)
            if i == 0:
                ax.legend(fontsize=7)
    save_plot(result.with_suffix(".png"), draw,
              f"FP8 projections by rows, {now['device_name']} (copy bandwidth {now['copy_bandwidth_gbs']:.0f} GB/s); "
              f"weights cycled past L2, one CUDA graph a cycle; torch {now['torch_version']}, triton "
              f"{now['triton_version']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--grid", action="store_true", help="also time split_k_matmul over a grid of tiles")
    parser.add_argument("--tag", default="", help="appended to the result's file name")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--plot", type=Path, default=None, help="draw this result's PNG and stop")
    parser.add_argument("--before", type=Path, default=None, help="with --plot: an earlier sweep to draw beside")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.before)
        return
    bandwidth = copy_bandwidth(torch.device("cuda"))
    served = Fp8Matmul("cuda", triton=True)
    counts = fp8_kernels.split_k_counts(torch.device("cuda"))
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = weight_copies(n, k)
        copies = len(weights)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_kernels.quantize_rows(x)
            want = served(x, *weights[0], None).float()
            row = {"shape": name, "n": n, "k": k, "rows": m, "floor_us": 1e6 * n * k / bandwidth,
                   "served_us": per_call_us(lambda i: served(x, *weights[i], None), copies),
                   "quantize_us": per_call_us(lambda i: fp8_kernels.quantize_rows(x), copies),
                   "scaled_mm_us": per_call_us(lambda i: torch._scaled_mm(
                       xq, weights[i][0].t(), scale_a=xs, scale_b=weights[i][1].view(1, -1),
                       out_dtype=torch.bfloat16), copies),
                   "split_k_config": fp8_kernels.split_k_config(m, k, n), "configs": []}
            row["served_vs_floor"] = row["served_us"] / row["floor_us"]
            if args.grid:
                def call_for(c: fp8_kernels.SplitKConfig) -> Callable[[int], torch.Tensor]:
                    return lambda i: fp8_kernels.split_k_matmul(xq, xs, *weights[i], None, torch.bfloat16, counts, c)

                row["configs"] = sweep_configs(grid(m), refine, call_for,
                                               lambda c: float((call_for(c)(0).float() - want).abs().max()),
                                               "max_abs_vs_served", copies)
            best = min(row["configs"], key=lambda r: r["us"]) if row["configs"] else None
            row["best_split_k"] = best
            print(f"{name} m={m}: floor {row['floor_us']:.1f} served {row['served_us']:.1f} "
                  f"({row['served_vs_floor']:.2f}x) quant {row['quantize_us']:.1f} scaled_mm {row['scaled_mm_us']:.1f} "
                  f"config {row['split_k_config']}"
                  + (f" grid best {best['us']:.1f} {best['config']}" if best else ""), flush=True)
            rows_out.append(row)
        weights.clear()
        torch.cuda.empty_cache()
    write_sweep(args.out, f"fp8_split_k_sweep{args.tag}", bandwidth, rows_out)


if __name__ == "__main__":
    main()
