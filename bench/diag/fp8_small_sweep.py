"""Configurations of fp8_kernels.small_matmul (BLOCK_N, BLOCK_K, warps, stages) at the
Llama-3.1-8B projection shapes and one row, against Fp8Matmul as it stands (small_matmul with its
chosen configuration up to SMALL_MATMUL_MAX_ROWS rows, torch._scaled_mm above) and the FP8 floor
(weight bytes / copy bandwidth); per call, 50 calls in one CUDA graph.

    python -m bench.diag.fp8_small_sweep --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.diag.fp8_gemm import per_call_s, quantized_weights
from bench.offline_throughput import copy_bandwidth
from engine.quant import fp8_kernels
from engine.quant.fp8 import Fp8Matmul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    cublas = Fp8Matmul("cuda", triton=True)
    results = []
    for name, n, k, _, wq, ws in quantized_weights():
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = cublas(x, wq, ws, None).float()
            row = {"shape": name, "rows": m, "floor_us": 1e6 * n * k / bandwidth,
                   "fp8_matmul_us": 1e6 * per_call_s(lambda: cublas(x, wq, ws, None)), "configs": []}
            grid = itertools.product([4, 8, 16, 32], [256, 512, 1024, 2048], [4, 8, 16], [3, 4, 6, 8])
            for bn, bk, warps, stages in (c for c in grid if 2048 <= m * c[0] * c[1] <= 64 * 32 * c[2]):
                def call() -> torch.Tensor:
                    return fp8_kernels.small_matmul(x, wq, ws, None, (bn, bk, warps, stages))
                try:
                    error = float((call().float() - want).abs().max())
                except Exception as e:  # noqa: BLE001 (a configuration past the shared memory: skipped)
                    print(f"  skipped {bn, bk, warps, stages}: {type(e).__name__}", flush=True)
                    continue
                row["configs"].append({"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                                       "us": 1e6 * per_call_s(call), "max_abs_vs_cublas": error})
            best = min(row["configs"], key=lambda c: c["us"])
            print(f"{name} rows={m}: floor {row['floor_us']:.1f} Fp8Matmul {row['fp8_matmul_us']:.1f} best {best}",
                  flush=True)
            results.append(row)
    slug = torch.cuda.get_device_name().lower().replace(" ", "-")
    (args.out / f"fp8_small_sweep_{slug}.json").write_text(json.dumps(
        {"device_name": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth / 1e9, "rows": results},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
