"""How fast the 4-bit kernels (W4A16, group 128) multiply Llama-3.1-8B's projections (qkv, o, gate_up,
down) by rows, over a grid of tiles, beside `read`: bytes-layout weight tiles read and their bytes
summed, no product (what reading costs alone). Each timing cycles through copies of the weight
holding at least 256 MiB together (no call finds its weight in L2); one CUDA graph of a cycle, the
median of 10 replays. Outputs are checked against `int4.dequantize` then a float32 product first.

What the runs on one H200 found (bench/results/int4_gemv_sweep_nvidia-h200_r*.json; best tile each,
time / floor of weight + scale bytes over the copy bandwidth; sums over the four projections):
  r1-r5  a CUDA-core kernel for one or two rows (the engine's until r8), its conversion of a nibble
      cut from 6.4 to 4.3 instructions a weight: 90.6 us at one row (2.9-4.5x the floor), 148.8 at
      two; reading alone 1.1-2.1x. A third fewer instructions bought 12%: not the instruction count
      alone bounded it.
  r6  tensor cores, a byte's nibbles as columns j and 64 + j of a group: the weight as the product's
      first operand (wgmma) 93 us at one row and 96 at 16 (the tile kernel then: 281); x first
      (mma.sync) 1.3-1.5x slower; a byte's nibbles as columns 2j, 2j + 1 (x loads strided) 1.3-1.5x
      slower.
  r7  a tile's group contiguous, the zero point taken from each weight (packed adds) rather than
      through x's sums over the group, int32 words with nibble i of word w column 16 i + w (eight
      products of 16 columns), one PTX block converting two words: 71.4 us at one row, 83.0 at 16
      (`words_asm_zsub`); each of the four choices gained alone.
  r8  that kernel (int4_kernels.words_matmul since) by rows: 70.7 / 72.0 / 76.7 / 83.1 / 152.6 us
      at 1 / 2 / 8 / 16 / 64 rows, against the CUDA-core kernel's 91.1 and 140.1 at one and two and
      the tile kernel's 280 / 281 / 519 at 8, 16 and 64; at one row gate_up 2.0x its floor, down 2.6x,
      qkv 3.3x, o 4.1x (their fixed costs). Tiles of 64 rows (the layout's) and split-K to 512
      programs were the best or within 4% of it up to 16 rows.
  r9  prefill rows: the kernel over a grid of 64-row tiles against dequantizing in torch and
      multiplying in cuBLAS (`dequantize`): 418 against 2,864 us at 256 rows, 2,816 against 3,808
      at 2,048.
  r10 against int4_kernels.dequantize_words (one kernel, bit for bit int4.dequantize) then cuBLAS
      (`words_dequantize`): 186 against 319 us at 64 rows, 401 (K unsplit; 314 split as at 64 rows)
      against 332 at 128, 550-600 against 366 at 256, 2,822 against 1,309 at 2,048: the kernel
      takes up to 64 rows (WORDS_MAX_ROWS), the dequantization more.

    python -m bench.diag.int4_gemv_sweep --out DIR [--rows 1 16] [--variants words read]
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
from engine.quant.int4 import dequantize, to_words

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336)}
GROUP = 128
CYCLE_BYTES = 256 << 20


@triton.jit
def _read_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_sn, stride_o,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """No product: bytes-layout weight tiles read and their bytes summed (what reading costs alone)."""
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


def words(x, w, s, layouts, cfg):
    """int4_kernels.words_matmul at (block_n, block_m, split_k)."""
    if x.device not in COUNTS:
        COUNTS[x.device] = int4_kernels.split_k_counts(x.device)
    return int4_kernels.words_matmul(x, *layouts[cfg[0]], None, cfg[0], COUNTS[x.device], cfg[1:])


COUNTS: dict[torch.device, torch.Tensor] = {}
VARIANTS: dict[str, Callable] = {
    "words": words,
    "dequantize": lambda x, w, s, layouts, cfg: torch.nn.functional.linear(x, dequantize(w, s, x.dtype)),
    "words_dequantize": lambda x, w, s, layouts, cfg: torch.nn.functional.linear(
        x, int4_kernels.dequantize_words(*layouts[64], x.dtype, 64)),
    "read": lambda x, w, s, layouts, cfg: launch(_read_kernel, x, w, s, cfg),
}


def configs(variant: str, rows: int) -> list[tuple[int, ...]]:
    if variant == "words":  # (block_n, block_m, split_k)
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
        return list(itertools.product([32, 64, 128], [block_m], [1, 2, 4, 8, 16]))
    if variant in ("dequantize", "words_dequantize"):  # the torch reference path; the Triton one then cuBLAS
        return [()]
    tiles = itertools.product([8, 16, 32, 64], [256, 512, 1024, 2048], [4, 8], [3])
    return [(bn, bk, warps, stages) for bn, bk, warps, stages in tiles if bn * bk <= 65536]


def word_layouts(w: torch.Tensor, s: torch.Tensor) -> dict:
    """int4.to_words' weight and scales by tile rows."""
    return {bn: to_words(w, s, bn) for bn in (32, 64, 128)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--variants", nargs="+", default=["words", "read"], choices=list(VARIANTS))
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
        weights = [(w, s, word_layouts(w, s)) for w, s in weights]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            want = x.float() @ dequantize(*weights[0][:2], torch.float32).T
            floor_us = 1e6 * nbytes / bandwidth
            for variant in args.variants:
                fn = VARIANTS[variant]
                best = None
                for cfg in configs(variant, m):
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
