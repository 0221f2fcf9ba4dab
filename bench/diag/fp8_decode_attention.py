"""Why the decode attention kernel reads an FP8 KV cache slower than a bfloat16 one (LAB ONLY).

`bench.profile_step` on one H200 (Llama-3.1-8B shape, context 1500): `_decode_kernel` took 14.9 ms a step at
batch 256 with the FP8 cache against 13.3 ms in bfloat16, and 4.9 against 3.2 ms at batch 64, though it reads
half the bytes. This times, at the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, 16-token
blocks), one layer's decode launch over a paged cache of random non-contiguous blocks:
- the product's `decode_attention` on a bfloat16 and an FP8 cache, with the engine's split plan;
- a lab copy of its kernel (one split, below) on the FP8 cache, by how it turns the FP8 tiles into dot
  operands (`bf16`: as the product, `f16`: half precision, which Hopper converts from E4M3 in one instruction
  (q clamped to its range)), how it loads K (`cols`: a [head_dim, keys] tile as the product, `rows`: [keys,
  head_dim] then transposed), keys a tile, warps, stages and the registers a thread may take;
or with no dots (`loads`: the tiles loaded, converted and summed, what the reads alone take), or `f16v` (the
product's since: values converted before their dot); by the grid's
order (`--grids`: `seq`, sequences fastest as the product, or `head`, a sequence's KV heads launched side by
side so they read the same cache rows at once); each beside the floor
(K/V bytes / the copy bandwidth), with its error against the product's FP8 output; and by how the cache lies in
memory (`--layouts`, paged_cache).

Found (one H200, batch 256, context 1500, floor 193 us; the `_dots`, `_ahead`, `_layout`, `_maxnreg` and
`_ncu` results): the loads alone took as long as the whole kernel (330 us); ncu: 212 registers a thread, two
programs an SM, half the DRAM bandwidth used; a program's time a tile is its loads' latency. Head-major
blocks gained 1-3%; dots on FP8 tensor cores (queries and weights in E4M3) nothing, at 3.5% error; loads
issued a tile ahead in registers ran slower (more registers still). Capping registers at 128 took the
kernel to 286 us (512 sequences: 641 -> 546 us), which the product took then.
Later (`_values_f16`, `_values_f16_main`, one H200, one call each): the product at 6e66d4f took 471 us at batch 256 and
922 at 512 (it had grown past the cap: compiled offline for sm_90 it keeps 336 bytes a thread in local memory),
and both it and this lab copy read each E4M3 value of a tile from shared memory alone (`ld.shared.b8`, 128 a
thread a tile): Triton moves the values' conversion after their trip into the dot's layout, and ldmatrix
transposes 16-bit values only. Converting them first (inline PTX that Triton cannot move) and dropping the cap:
282 us at 256, 530 at 512, 96 at 64 (`--tiles`: the product's kernel at other tiles).
Each cache block's keys of a head read by one TMA copy (16 or 32 keys a tile) took twice as long
(591 us at batch 256, `_tma`); two or four KV heads a program with batched dots (a key's 256 or 512 bytes
read as one run) ran slower and the grid's order made no difference (`_grid_heads`): both variants are gone
but the grid's order, a knob. The dots with the keys as M (scores^T = K q^T, out^T += V^T p^T, keys and values
read as [keys, head_dim] rows and converted where loaded), which Hopper's warpgroup MMA takes where the product
pads 4 query rows to M = 16: 329 us at batch 256 and 634 at 512 against this copy's f16v 281 / 517 and the
product's 275 / 505 (`_swap`, 128-key tiles, 4 warps, their best): gone.
With the 64-key / 2-warp / 3-stage tiles (`_orders`, `_orders_wide`, one call): where a sequence's blocks lie made no
difference: drawn at random, one run each (a prompt prefilled from a fresh pool), or a sequence's i-th block beside
the others' i-th (as decode steps append them), in a cache of the batch's blocks or of the engine's 119,033: 484-491
us at batch 512 (floor 393), 263-267 at 256 (floor 196), all within 2%. The bfloat16 kernel read at the floor there
(750 us, floor 785 by the copy bandwidth). `_k8` (one call): keys read as E4M3 dot operands with no conversion, the
queries as two E4M3 terms of a row's scale (error 1.6e-3 against the product), took 558 us at 512 and 285 at 256
against this copy's f16v 502 / 277; a variant with no float conversion at all (the tiles' bytes summed as
integers) ran slower than the whole kernel (629 / 325 us), so it bounds nothing: both gone.
`_small_tiles` (one call): one warp a program ran batch 256 in 244 us against 266 (64 keys, 3 or 4 stages), even at
512 (484), slower at 64 (78-85 against 76); 32 and 16 keys a tile no better. The product takes 64 / 1 / 4 for
crowded launches since (TritonAttentionConfig.decode_fp8_crowded_*; `product_launch` picks as the engine does).

    python -m bench.diag.fp8_decode_attention --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench.offline_throughput import copy_bandwidth
from engine.attention.triton_backend import TritonAttentionConfig, decode_launch_plan
from engine.attention.triton_kernels import LOG2E, _values_as_f16, decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@triton.jit
def _queries(q_ptr, seq, kv_head, stride_qt, stride_qh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_M: tl.constexpr):
    """The GROUP query heads of kv_head for one sequence, as BLOCK_M rows (the rest zero): (q, heads, row_ok)."""
    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    return q, heads, row_ok


@triton.jit
def _as_f16(q):
    """Queries as float16 operands, clamped to its range (E4M3 converts to float16 in one instruction)."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _store(out_ptr, o, seq, heads, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _lab_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOTS: tl.constexpr, K_ROWS: tl.constexpr, HEAD_FIRST: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, num_kv_heads), or its transpose: the product's `_decode_kernel` with one split, every
    sequence one query."""
    seq, kv_head = _program_ids(HEAD_FIRST)
    seq_len = tl.load(seq_lens_ptr + seq)
    q, heads, row_ok = _queries(q_ptr, seq, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    if DOTS == "f16" or DOTS == "f16v":
        q = _as_f16(q)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for j in range(0, seq_len, BLOCK_N):
        keys = j + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        if K_ROWS:
            k = tl.trans(tl.load(
                k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
                + d[None, :], mask=key_ok[:, None], other=0.0))
        else:
            k = tl.load(k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko + kv_head * stride_kh
                        + d[:, None], mask=key_ok[None, :], other=0.0)
        if DOTS == "loads":  # no dots: what the loads and conversions alone take
            s = tl.broadcast_to(tl.sum(k.to(tl.float32), 0)[None, :], [BLOCK_M, BLOCK_N]) * scale_log2
        else:
            s = tl.dot(q, k.to(q.dtype)) * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
                    + d[None, :], mask=key_ok[:, None], other=0.0)
        if DOTS == "loads":
            acc = acc * alpha[:, None] + tl.sum(v.to(tl.float32), 0)[None, :] * tl.sum(p, 1)[:, None]
        else:
            if DOTS == "f16v":  # the product's values, converted before their dot
                v = _values_as_f16(v)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    _store(out_ptr, acc / l[:, None], seq, heads, row_ok, stride_qt, stride_qh, HEAD_DIM)


@triton.jit
def _program_ids(HEAD_FIRST: tl.constexpr):
    """(seq, kv-head group) of this program: grid (seqs, groups) as the product, or (groups, seqs)."""
    if HEAD_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


Config = tuple[str, str, int, int, int, int, str]
"""(dots, k loads, keys a tile, warps, stages, maxnreg, grid order)."""


def lab_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, config: Config) -> torch.Tensor:
    dots, k_load, block_n, num_warps, num_stages, maxnreg, grid = config
    out = torch.empty_like(q)
    cap = {"maxnreg": maxnreg} if maxnreg else {}
    head_first = grid == "head"
    shape = (KV_HEADS, q.shape[0]) if head_first else (q.shape[0], KV_HEADS)
    common = (q, k_cache, v_cache, out, block_tables, seq_lens, scale * LOG2E, q.stride(0), q.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))
    _lab_decode_kernel[shape](
        *common, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_M=16, BLOCK_N=block_n, BLOCK_SIZE=BLOCK_SIZE,
        DOTS=dots, K_ROWS=k_load == "rows", HEAD_FIRST=head_first, num_warps=num_warps, num_stages=num_stages,
        **cap,
    )  # fmt: skip
    return out


def median_us(fn: Any) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def paged_cache(num_blocks: int, dtype: torch.dtype, layout: str, device: torch.device) -> torch.Tensor:
    """[num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM] as the kernels index it; `token`: stored so (a token's heads
    side by side, one head's keys of a block 128 B rows 1 KB apart in FP8), `head`: stored
    [num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM] and viewed through strides (one head's keys of a block in one
    run of bytes)."""
    if layout == "token":
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        return torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype).permute(0, 2, 1, 3)


def product_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sms: int,
                   cfg: TritonAttentionConfig) -> tuple[Callable[[], torch.Tensor], int, Any]:
    """The product's decode launch over this cache with cfg's tiles and split plan: (a call returning its output,
    its splits, its tiles)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    num_splits, tps, tiles = decode_launch_plan(q.shape[0], KV_HEADS, int(seq_lens.max()), sms, cfg, fp8_cache=fp8)
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        decode_attention(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale=scale,
                         sliding_window=None, num_splits=num_splits, tokens_per_split=tps, max_splits=cfg.max_splits,
                         block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        return out

    return run, num_splits, tiles


def point(batch: int, context: int, bandwidth: float, configs: list[Config],
          layouts: list[str], tiles_list: list[tuple[int, int, int]]) -> dict[str, Any]:
    device = torch.device("cuda")
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    order = list(range(1, num_blocks))
    random.Random(batch).shuffle(order)
    block_tables = torch.tensor(order, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    scale = HEAD_DIM ** -0.5
    row: dict[str, Any] = {"batch": batch, "context": context}
    cfg = TritonAttentionConfig()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for layout, dtype in itertools.product(layouts, (torch.bfloat16, torch.float8_e4m3fn)):
        fp8 = dtype == torch.float8_e4m3fn
        k_cache = paged_cache(num_blocks, dtype, layout, device)
        v_cache = paged_cache(num_blocks, dtype, layout, device)
        launch = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sms)
        product, num_splits, tiles = product_launch(*launch, cfg)
        name = f"{'fp8' if fp8 else 'bf16'}_{layout}"
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
        ref = product().float().clone()
        row[f"product_{name}"] = {"us": median_us(product), "floor_us": 1e6 * kv_bytes / bandwidth,
                                  "num_splits": num_splits, "tiles": list(tiles)}
        print(f"batch {batch} ctx {context} product {name}: {row[f'product_{name}']}", flush=True)
        if not fp8:
            continue
        row[f"product_tiles_{name}"] = []
        for block_n, num_warps, num_stages in tiles_list:  # the product's kernel at other tiles, its own split plan
            other, splits, _ = product_launch(*launch, TritonAttentionConfig(
                decode_fp8_block_n=block_n, decode_fp8_num_warps=num_warps, decode_fp8_num_stages=num_stages,
                decode_fp8_crowded_num_warps=num_warps, decode_fp8_crowded_num_stages=num_stages))
            err = float((other().float() - ref).norm() / ref.norm())
            result = {"tiles": [block_n, num_warps, num_stages], "num_splits": splits, "us": median_us(other),
                      "rel_err_vs_product": err}
            row[f"product_tiles_{name}"].append(result)
            print(f"  product tiles {result}", flush=True)
        row[f"lab_{name}"] = []
        for c in configs:
            try:
                got = lab_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, c).float()
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build: skipped
                print(f"  skipped {c}: {type(e).__name__}", flush=True)
                continue
            err = float((got - ref).norm() / ref.norm())
            us = median_us(lambda: lab_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, c))
            row[f"lab_{name}"].append({"config": c, "us": us, "rel_err_vs_product": err})
            print(f"  {layout} {c}: {us:.1f} us (floor {row[f'product_{name}']['floor_us']:.1f}), err {err:.1e}",
                  flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", default="256:1500,64:1500")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--dots", default="bf16,f16", help="of bf16 f16 f16v (f16, the values converted as the "
                        "product converts them) loads; empty: the lab copy not run")
    parser.add_argument("--k-loads", default="cols,rows")
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--maxnreg", default="0", help="registers a thread at most (Triton's maxnreg); 0: no cap")
    parser.add_argument("--grids", default="seq", help="of seq head (_program_ids)")
    parser.add_argument("--layouts", default="token", help="of token head (paged_cache)")
    parser.add_argument("--tiles", default="", help="the product's kernel with other tiles too: comma-separated "
                        "block_n:warps:stages")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    tiles_list = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",") if t]
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    configs = [] if not args.dots else list(itertools.product(
        args.dots.split(","), args.k_loads.split(","), ints(args.block_n), ints(args.warps), ints(args.stages),
        ints(args.maxnreg), args.grids.split(",")))
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for p in args.points.split(","):
        batch, context = (int(x) for x in p.split(":"))
        rows.append(point(batch, context, bandwidth, configs, args.layouts.split(","), tiles_list))
    name = torch.cuda.get_device_name()
    slug = name.lower().replace(" ", "-")
    (args.out / f"fp8_decode_attention{args.tag}_{slug}.json").write_text(json.dumps(
        {"lab_only": "a copy of the decode kernel with knobs, to find why FP8 reads are slow", "device_name": name,
         "torch_version": torch.__version__, "triton_version": triton.__version__,
         "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
