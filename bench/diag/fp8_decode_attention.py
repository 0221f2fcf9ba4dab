"""Why the decode attention kernel reads an FP8 KV cache slower than a bfloat16 one (LAB ONLY).

`bench.profile_step` on one H200 (Llama-3.1-8B shape, context 1500): `_decode_kernel` took 14.9 ms a step at
batch 256 with the FP8 cache against 13.3 ms in bfloat16, and 4.9 against 3.2 ms at batch 64, though it reads
half the bytes. This times, at the 8B attention shape (32 query heads, 8 KV heads, head_dim 128, 16-token
blocks), one layer's decode launch over a paged cache of random non-contiguous blocks:
- the product's `decode_attention` on a bfloat16 and an FP8 cache, with the engine's split plan;
- a lab copy of its kernel (one split, below) on the FP8 cache, by how it turns the FP8 tiles into dot
  operands (`bf16`: as the product, `f16`: half precision, which Hopper converts from E4M3 in one instruction
  (q clamped to its range)), how it loads K (`cols`: a [head_dim, keys] tile as the product, `rows`: [keys,
  head_dim] then transposed), keys a tile, warps and stages;
each beside the floor (K/V bytes / the copy bandwidth), with its error against the product's FP8 output.
The committed result (`fp8_decode_attention_nvidia-h200.json`) was taken when the product's FP8 path was the
lab's `bf16, cols, 64, 4, 2`; the product has taken `f16, cols, 128, 4, 3` since, so a run now times that as
"product fp8".

    python -m bench.diag.fp8_decode_attention --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench.offline_throughput import copy_bandwidth
from engine.attention.triton_backend import TritonAttentionConfig, decode_split_plan
from engine.attention.triton_kernels import LOG2E, decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@triton.jit
def _lab_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, F16: tl.constexpr, K_ROWS: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, num_kv_heads): the product's `_decode_kernel` with one split, every sequence one query."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
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
        s = tl.dot(q, k.to(q.dtype)) * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko + kv_head * stride_kh
                    + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    o = acc / l[:, None]
    tl.store(out_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def lab_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, config: tuple[str, str, int, int, int]) -> torch.Tensor:
    dots, k_load, block_n, num_warps, num_stages = config
    out = torch.empty_like(q)
    _lab_decode_kernel[(q.shape[0], KV_HEADS)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_M=16, BLOCK_N=block_n, BLOCK_SIZE=BLOCK_SIZE,
        F16=dots == "f16", K_ROWS=k_load == "rows", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def median_us(fn: Any) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def point(batch: int, context: int, bandwidth: float, configs: list[tuple[str, str, int, int, int]]) -> dict[str, Any]:
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
    outs = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype)
        v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype)
        cfg = TritonAttentionConfig()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        num_splits, tps = decode_split_plan(batch, KV_HEADS, context, sms, cfg)
        out = torch.empty_like(q)

        def product() -> None:
            decode_attention(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale=scale,
                             sliding_window=None, num_splits=num_splits, tokens_per_split=tps,
                             max_splits=cfg.max_splits, block_n=cfg.decode_block_n, num_warps=cfg.decode_num_warps,
                             num_stages=cfg.decode_num_stages)

        name = "bf16" if dtype == torch.bfloat16 else "fp8"
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
        product()
        outs[name] = out.clone()
        row[f"product_{name}"] = {"us": median_us(product), "floor_us": 1e6 * kv_bytes / bandwidth,
                                  "num_splits": num_splits}
        print(f"batch {batch} ctx {context} product {name}: {row[f'product_{name}']}", flush=True)
        if dtype != torch.float8_e4m3fn:
            continue
        ref = outs["fp8"].float()
        row["lab_fp8"] = []
        for c in configs:
            try:
                got = lab_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, c).float()
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build: skipped
                print(f"  skipped {c}: {type(e).__name__}", flush=True)
                continue
            err = float((got - ref).norm() / ref.norm())
            us = median_us(lambda: lab_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, c))
            row["lab_fp8"].append({"config": c, "us": us, "rel_err_vs_product": err})
            print(f"  {c}: {us:.1f} us (floor {row['product_fp8']['floor_us']:.1f}), err {err:.1e}", flush=True)
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", default="256:1500,64:1500")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    configs = [(dots, k_load, bn, w, s) for dots, k_load, bn, w, s in itertools.product(
        ["bf16", "f16"], ["cols", "rows"], [64, 128], [4, 8], [2, 3])]
    rows = []
    for p in args.points.split(","):
        batch, context = (int(x) for x in p.split(":"))
        rows.append(point(batch, context, bandwidth, configs))
    name = torch.cuda.get_device_name()
    slug = name.lower().replace(" ", "-")
    (args.out / f"fp8_decode_attention_{slug}.json").write_text(json.dumps(
        {"lab_only": "a copy of the decode kernel with knobs, to find why FP8 reads are slow", "device_name": name,
         "torch_version": torch.__version__, "triton_version": triton.__version__,
         "copy_bandwidth_gbs": bandwidth / 1e9, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
