"""How fast `int4_kernels.small_matmul` (W4A16, group 128, one or two rows) reads its weight, over a
grid of tiles, beside `read`: the same weight tiles read and their bytes summed, no product (what
reading alone costs). Shapes: Llama-3.1-8B's projections (qkv, o, gate_up, down). Each timing
cycles through copies of the weight holding at least 256 MiB together (no call finds its weight
in L2); one CUDA graph of a cycle, the median of 10 replays. Outputs are checked against
`int4.dequantize` then a float32 product first.

What the runs on one H200 found (bench/results/int4_gemv_sweep_nvidia-h200_r*.json; one row, best
tile each, time / floor of weight + scale bytes over the copy bandwidth):
  r1  small_matmul as it was (int-to-float conversion, nibbles joined and reshaped) 3.7-5.1x; the
      same with the float-bits conversion (q | 0x4B000000 is the float 2^23 + q; one subtraction of
      2^23 + z gives q - z) 3.2-4.4x; each group's products summed within the K step, then scaled
      once, 6.0-7.4x
  r2  the float-bits kernel over K slices a program (2-16; more programs, fewer steps each) and an
      ordered sum of the slices: 4.5-6.0x, slower at every split
  r3  the float-bits kernel with each group loaded and scaled on its own (no reshape): 3.5-5.6x;
      at two rows the float-bits kernel 4.6-5.9x against the old kernel's 4.4-5.7x
  r4  reading alone 1.1-2.1x (gate_up 1.09x); one row in 2-D tiles with int32 words, scales
      gathered a word, 6.7-9.0x
  r5  int32 words, a nibble made a float by one AND-OR under a 1.0 or 16.0 exponent, the zero point
      and scale applied a word (4.3 instructions a weight in the compiled loop against 6.4), against
      the float-bits kernel in the same call (`_r5_words`, `_r5_before_words`): one row, best tiles,
      qkv 12.5 vs 14.3 us, o 9.8 vs 9.5, gate_up 44.3 vs 52.8, down 24.0 vs 24.7 (2.9-4.5x the
      floor); summed over the four at one tile each, 90.6 vs 103.0 us at one row (16 x 1,024 both)
      and 148.8 vs 154.7 at two (16 x 512 vs the old default 16 x 256; the old kernel's best, 8 x 512,
      144.4). The words kernel became small_matmul's.
So the product, not the read, bounds the kernel, and not by its instruction count alone: a third
fewer instructions a weight bought 12% at one row. What would reach the goal is likely tensor cores
fed by a cheaper conversion (two nibbles a half2 instruction, as Marlin converts), not measured here.

    python -m bench.diag.int4_gemv_sweep --out DIR [--rows 1 2] [--variants small_matmul read]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.common import device_slug, graph_seconds
from bench.offline_throughput import copy_bandwidth
from engine.quant import int4_kernels
from engine.quant.int4 import dequantize

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336)}
GROUP = 128
CYCLE_BYTES = 256 << 20


@triton.jit
def _read_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """No product: small_matmul's weight tiles read and their bytes summed (what reading costs alone)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.int32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        tile = tl.load(w_ptr + rn[:, None] * stride_w + (k0 // 2 + j)[None, :], mask=n_ok[:, None], other=0)
        acc += tile.to(tl.int32)
    tl.store(out_ptr + rn, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def launch(kernel: Callable, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: tuple[int, ...]):
    bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, bn),)](x, w, s, out, m, n, k, x.stride(0), w.stride(0), s.stride(0), out.stride(0),
                                  GROUP=GROUP, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk,
                                  NUM_STAGES=stages, num_warps=warps)
    return out


VARIANTS: dict[str, Callable] = {
    "small_matmul": lambda x, w, s, cfg: int4_kernels.small_matmul(x, w, s, None, cfg),
    "read": lambda x, w, s, cfg: launch(_read_kernel, x, w, s, cfg),
}


def configs(variant: str) -> list[tuple[int, ...]]:
    tiles = itertools.product([8, 16, 32, 64], [256, 512, 1024, 2048], [4, 8], [3])
    return [(bn, bk, warps, stages) for bn, bk, warps, stages in tiles
            if bn * bk <= (65536 if variant == "read" else 32768)]  # past it an accumulator spills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tag", default="", help="appended to the output file's name")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + n * (k // GROUP) * 4
        copies = max(2, -(-CYCLE_BYTES // nbytes))
        weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen),
                    torch.stack([torch.rand(n, k // GROUP, device=device, generator=gen) * 0.02 + 0.001,
                                 torch.randint(0, 16, (n, k // GROUP), device=device, generator=gen).float()],
                                -1).half())
                   for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            want = x.float() @ dequantize(*weights[0], torch.float32).T
            floor_us = 1e6 * nbytes / bandwidth
            for variant in args.variants:
                fn = VARIANTS[variant]
                best = None
                for cfg in configs(variant):
                    try:
                        got = fn(x, *weights[0], cfg).float()
                    except Exception as err:  # a tile past shared memory or registers: skipped, named
                        print(f"{name} m={m} {variant} {cfg}: {type(err).__name__}", flush=True)
                        continue
                    err = None if variant == "read" else float((got - want).norm() / want.norm())
                    if err is not None and err > 2e-2:
                        print(f"{name} m={m} {variant} {cfg}: rel_err {err:.2e}: wrong", flush=True)
                        continue
                    it = iter(itertools.cycle(range(copies)))
                    us = 1e6 * graph_seconds(lambda: fn(x, *weights[next(it)], cfg), device, copies) / copies
                    row = {"shape": name, "n": n, "k": k, "rows": m, "variant": variant, "config": cfg, "us": us,
                           "floor_us": floor_us, "vs_floor": us / floor_us, "rel_err": err}
                    rows_out.append(row)
                    if best is None or us < best["us"]:
                        best = row
                if best:
                    print(f"{name:11s} m={m} {variant:12s} best {best['us']:7.1f} us = {best['vs_floor']:.2f}x floor "
                          f"({best['floor_us']:.1f} us) at {best['config']}, rel_err {best['rel_err']}",
                          flush=True)
    doc = {"benchmark": "int4_gemv_sweep", "device_name": torch.cuda.get_device_name(device),
           "copy_bandwidth_gbs": bandwidth / 1e9, "torch_version": torch.__version__,
           "triton_version": triton.__version__, "python": platform.python_version(), "rows": rows_out}
    path = args.out / f"int4_gemv_sweep_{device_slug(device)}{args.tag}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
