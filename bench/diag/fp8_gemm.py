"""Where an FP8 projection's time goes at the Llama-3.1-8B shapes, by rows (tokens): bfloat16
F.linear, torch._scaled_mm on pre-quantized operands, the Triton activation quantization alone, and
the whole Fp8Matmul, and the one-launch small_matmul (Triton; quantization inside); each 50 calls
captured in one CUDA graph, median of 10 replays, per call.
The floor: the weight bytes / measured copy bandwidth.

    python -m bench.diag.fp8_gemm --out DIR
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench.common import graph_seconds
from bench.offline_throughput import copy_bandwidth
from engine.quant import fp8_kernels
from engine.quant.fp8 import Fp8Matmul, quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def per_call_s(fn: Callable[[], object], calls: int = 50) -> float:
    return graph_seconds(fn, torch.device("cuda"), calls) / calls


def quantized_weights() -> Iterator[tuple[str, int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per shape: (name, out, in, a bfloat16 weight of std 0.02, its FP8 values, their scales [out])."""
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows(w)
        yield name, n, k, w, wq, ws.view(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    fast = Fp8Matmul("cuda", triton=True)
    rows_out = []
    for name, n, k, w, wq, ws in quantized_weights():
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fp8_kernels.quantize_rows(x)
            row = {
                "shape": name, "n": n, "k": k, "rows": m,
                "bf16_linear_us": 1e6 * per_call_s(lambda: torch.nn.functional.linear(x, w)),
                "scaled_mm_us": 1e6 * per_call_s(lambda: torch._scaled_mm(
                    xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)),
                "quantize_us": 1e6 * per_call_s(lambda: fp8_kernels.quantize_rows(x)),
                "fp8_matmul_us": 1e6 * per_call_s(lambda: fast(x, wq, ws, None)),
                "small_matmul_us": (1e6 * per_call_s(lambda: fp8_kernels.small_matmul(x, wq, ws, None))
                                    if m <= fp8_kernels.SMALL_MATMUL_MAX_ROWS else None),
                "bf16_floor_us": 1e6 * n * k * 2 / bandwidth, "fp8_floor_us": 1e6 * n * k / bandwidth,
            }
            rows_out.append(row)
            if m <= fp8_kernels.SMALL_MATMUL_MAX_ROWS:
                small = fp8_kernels.small_matmul(x, wq, ws, None).float()
                row["small_vs_fp8_matmul_max_abs"] = float((small - fast(x, wq, ws, None).float()).abs().max())
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    out = {"device_name": torch.cuda.get_device_name(), "torch_version": torch.__version__,
           "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows_out}
    slug = torch.cuda.get_device_name().lower().replace(" ", "-")
    (args.out / f"fp8_gemm_{slug}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
