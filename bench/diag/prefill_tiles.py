"""The prefill attention kernel's tiles, swept (LAB ONLY): `triton_prefill.prefill_attention` at the Llama-3.1-8B
attention shape (32 query heads, 8 KV heads, head_dim 128, 16-token blocks) over a paged cache of random
non-contiguous blocks, bfloat16 queries over a bfloat16 and an FP8 (E4M3) cache, for every (block_m, block_n,
num_warps, num_stages) of the grid, at prompt shapes the engine meets: eight prompts of 1,024 tokens (an offline
prompt step), one of 8,192 (a long prompt) and 512 new tokens on a 3,584-token prefix (a chunk of chunked
prefill). Each launch: `triton.testing.do_bench`'s median, its causal FLOPs (4 a visible query-key pair a head
dimension) as TFLOP/s, and its output's largest difference from the product's tiles' for that cache and case when it
ran (`prefill_launch_tiles`: crowded or not, at this device's SM count; `default` marks their rows). --product-only
times those alone.
Beside them, torch's SDPA (flash, causal, K/V contiguous and repeated to every head: no paging) on the prompts'
shapes, bfloat16: what a tuned kernel reaches here.

TritonAttentionConfig's prefill tiles were a first guess (128 rows x 64 keys, 8 warps, 2 stages), never swept on a
Hopper GPU before this. Found (one H200, `prefill_tiles_nvidia-h200_sweep`, its `default` rows that guess): no one
tile is best for both caches. Over bfloat16, 64 x 64, 4 warps, 2 stages took 269 / 1,574 / 119 us at the three
shapes against the guess's 318 / 1,756 / 133 (256-row tiles were faster at the two prompt shapes, 261 / 1,318, and
1.6x slower on the chunk: too few programs); over FP8, 64 x 128, 4 warps, 3 stages took 309 / 1,687 / 119 against
361 / 2,155 / 156, within 4% of each shape's best. The product takes those (TritonAttentionConfig.prefill_tiles).
At the 70B shape (`_heads64_8`) taller tiles won every case; a launch with query rows enough for every SM takes them
(README).
SDPA, bfloat16: 164 us (419 TFLOP/s) on eight prompts of 1,024 and 1,023 us (538) on one of 8,192, so the kernel
stays 1.5-1.6x off a tuned flash kernel.

    python -m bench.diag.prefill_tiles --out DIR [--heads 64:8] [--quick] [--product-only]  # --replot JSON: the PNG
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import device_name, device_slug, random_block_tables, timed
from engine.attention.triton_backend import TritonAttentionConfig, _num_sms, prefill_launch_tiles

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """The attention shape a launch serves: query heads, KV heads, head_dim."""

    heads: int = 32  # Llama-3.1-8B's (70B's: 64 / 8, a TP=2 rank's 32 / 4)
    kv_heads: int = 8
    head_dim: int = 128


CASES = {"8 x 1024": [(1024, 1024)] * 8, "1 x 8192": [(8192, 8192)], "extend 512 on 3584": [(512, 4096)]}
QUICK_CASES = {"2 x 64": [(64, 64)] * 2, "extend 16 on 48": [(16, 64)]}
GRID = {"block_m": (64, 128, 256), "block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
QUICK_GRID = {"block_m": (64,), "block_n": (32, 64), "num_warps": (4,), "num_stages": (2,)}


def batch(seqs: list[tuple[int, int]], shape: Shape, num_blocks: int, device: torch.device,
          gen: torch.Generator) -> dict:
    """Queries and the metadata of a step whose sequences (new tokens, context) hold distinct random blocks."""
    tables, starts = random_block_tables(seqs, num_blocks, BLOCK_SIZE)
    width = max(len(t) for t in tables)
    q = torch.randn(starts[-1], shape.heads, shape.head_dim, dtype=torch.bfloat16, device=device, generator=gen)
    return {
        "q": q,
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
    }


def causal_flops(seqs: list[tuple[int, int]], shape: Shape) -> float:
    """4 FLOPs a visible (query, key) pair a head dimension, every head: n * prefix + n (n + 1) / 2 pairs."""
    return sum(4 * (n * (s - n) + n * (n + 1) / 2) * shape.heads * shape.head_dim for n, s in seqs)


def run_prefill(step: dict, k: torch.Tensor, v: torch.Tensor, tiles: dict[str, int]) -> torch.Tensor:
    # NOTE: imported here: importing the kernel module at import would compile its kernels in a test session
    # before the interpreted kernel tests import it (tests/interpreted.py)
    from engine.attention.triton_prefill import prefill_attention

    out = torch.empty_like(step["q"])
    prefill_attention(step["q"], k, v, out, step["block_tables"], step["seq_lens"], step["query_start_loc"],
                      scale=k.shape[-1] ** -0.5, sliding_window=None, **tiles)
    return out


def seconds(fn: Any, device: torch.device) -> float:
    """do_bench's median on a GPU; one synchronised call elsewhere (the --quick CPU check)."""
    if device.type != "cuda":
        return timed(device, fn)[0]
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e-3


def sdpa_seconds(seqs: list[tuple[int, int]], shape: Shape, device: torch.device,
                 gen: torch.Generator) -> float | None:
    """SDPA on the prompts' shapes (equal fresh prompts only), K/V repeated to every head."""
    if len(set(seqs)) != 1 or seqs[0][0] != seqs[0][1] or device.type != "cuda":
        return None
    b, n = len(seqs), seqs[0][0]
    q = torch.randn(b, shape.heads, n, shape.head_dim, dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn(2, b, shape.kv_heads, n, shape.head_dim, dtype=torch.bfloat16, device=device, generator=gen)
    k, v = (t.repeat_interleave(shape.heads // shape.kv_heads, 1) for t in kv)
    return seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)


def product_tiles(cache: str, seqs: list[tuple[int, int]], shape: Shape, num_sms: int) -> dict[str, int]:
    """The tiles the product launches a step of these sequences at (`prefill_launch_tiles`: crowded or not)."""
    return prefill_launch_tiles(sum(n for n, _ in seqs), shape.heads, shape.kv_heads, num_sms, TritonAttentionConfig(),
                                cache == "fp8")._asdict()


def sweep(cache: str, cases: dict, grid: dict, shape: Shape, device: torch.device, seed: int,
          num_sms: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    need = max(sum(-(-s // BLOCK_SIZE) for _, s in seqs) for seqs in cases.values())
    dims = (need, BLOCK_SIZE, shape.kv_heads, shape.head_dim)
    k = torch.randn(dims, dtype=torch.bfloat16, device=device, generator=gen)
    v = torch.randn(dims, dtype=torch.bfloat16, device=device, generator=gen)
    if cache == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    rows = []
    every = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else []
    for name, seqs in cases.items():
        step = batch(seqs, shape, need, device, gen)
        chosen = product_tiles(cache, seqs, shape, num_sms)
        reference = run_prefill(step, k, v, chosen)
        for tiles in every + ([chosen] if chosen not in every else []):
            row = {"cache": cache, "case": name, **tiles, "default": tiles == chosen}
            try:
                out = run_prefill(step, k, v, tiles)
                row["max_diff"] = (out.float() - reference.float()).abs().max().item()
                row["us"] = seconds(lambda: run_prefill(step, k, v, tiles), device) * 1e6
                row["tflops"] = causal_flops(seqs, shape) / row["us"] * 1e-6
            except Exception as exc:  # out of shared memory and the like
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def best_by_case(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (cache, case): the time at the product's tiles when the sweep ran (`default`) and the fastest tiles'."""
    out: dict[str, Any] = {}
    for row in rows:
        if "us" not in row:
            continue
        key = f"{row['cache']} {row['case']}"
        entry = out.setdefault(key, {"default_us": None, "best": None})
        if row["default"]:
            entry["default_us"] = row["us"]
        if entry["best"] is None or row["us"] < entry["best"]["us"]:
            entry["best"] = row
    return out


def plot(record: dict[str, Any], path: Path) -> bool:
    """Per cache and shape, over the time at the product's tiles when the sweep ran: the product's tiles now, the
    sweep's best, SDPA beside bfloat16."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shape = Shape(record["shape"]["heads"], record["shape"]["kv_heads"], record["shape"]["head_dim"])
    keys = list(record["best"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width, labelled = 0.2, set()
    for i, key in enumerate(keys):
        cache, case = key.split(" ", 1)
        # NOTE: the sweeps before crowded tiles recorded no SM count: they ran on an H200 (132)
        chosen = product_tiles(cache, record["cases"][case]["seqs"], shape, record.get("num_sms", 132))
        product = next((r["us"] for r in record["rows"] if r["cache"] == cache and r["case"] == case and "us" in r
                        and all(r[k] == v for k, v in chosen.items())), None)
        bars = [("product's tiles when run", record["best"][key]["default_us"], "tab:gray"),
                ("product's tiles now", product, "tab:blue"),
                ("sweep's best", record["best"][key]["best"]["us"], "tab:green"),
                ("SDPA (bf16, unpaged)", record["sdpa_us"].get(case) if cache == "bf16" else None, "tab:orange")]
        for j, (label, us, color) in enumerate(bars):
            if us is not None:
                ax.bar(i + (j - 1.5) * width, us / record["best"][key]["default_us"], width, color=color,
                       label=None if label in labelled else label)
                labelled.add(label)
    ax.set_xticks(range(len(keys)), keys, rotation=15, fontsize=8)
    ax.set_ylabel("time / at the product's tiles when run")
    ax.set_title(f"prefill attention tiles, {shape.heads}:{shape.kv_heads} heads, {record['device_name']} (LAB ONLY)")
    ax.set_ylim(0, 1.35)
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--caches", default="bf16,fp8")
    parser.add_argument("--quick", action="store_true", help="two tiny cases, four tiles (a CPU check)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    parser.add_argument("--heads", default="32:8", help="query heads:KV heads (the 8B shape's; 70B's 64:8)")
    parser.add_argument("--replot", type=Path, help="only draw the PNG of this JSON again, and exit")
    parser.add_argument("--product-only", action="store_true", help="time only the product's tiles, no grid")
    args = parser.parse_args(argv)
    if args.replot:
        record = json.loads(args.replot.read_text())
        plot(record, args.replot.with_suffix(".png"))
        return record
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases, grid = (QUICK_CASES, QUICK_GRID) if args.quick else (CASES, GRID)
    grid = {} if args.product_only else grid
    heads, kv_heads = (int(n) for n in args.heads.split(":"))
    shape = Shape(heads, kv_heads)
    num_sms = _num_sms(device)  # as the backend counts them (the CPU: 8)
    rows = [row for cache in args.caches.split(",")
            for row in sweep(cache, cases, grid, shape, device, args.seed, num_sms)]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    sdpa = {name: s * 1e6 for name, seqs in cases.items() if (s := sdpa_seconds(seqs, shape, device, gen)) is not None}
    record = {"benchmark": "prefill_tiles (LAB ONLY)", "device_name": device_name(device),
              "torch_version": torch.__version__, "python": platform.python_version(),
              "shape": {**asdict(shape), "block_size": BLOCK_SIZE}, "num_sms": num_sms,
              "cases": {name: {"seqs": seqs, "flops": causal_flops(seqs, shape)} for name, seqs in cases.items()},
              "sdpa_us": sdpa, "rows": rows, "best": best_by_case(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"prefill_tiles_{device_slug(device)}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(record, indent=1))
    plot(record, path.with_suffix(".png"))
    for key, entry in record["best"].items():
        b = entry["best"]
        print(f"{key}: default {entry['default_us']:.1f} us; best {b['us']:.1f} us ({b['tflops']:.0f} TFLOP/s) at "
              f"{b['block_m']}x{b['block_n']} w{b['num_warps']} s{b['num_stages']}")
    for name, us in sdpa.items():
        print(f"sdpa {name}: {us:.1f} us ({causal_flops(cases[name], shape) / us * 1e-6:.0f} TFLOP/s)")
    return record


if __name__ == "__main__":
    main()
