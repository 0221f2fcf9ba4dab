"""The Triton attention backend on a GPU: correctness at real shapes, then speed against floors.

Model shapes (attention only) come from bench/shapes/<name>/config.json: Qwen3-0.6B (16 query
heads, 8 KV heads, head_dim 128) and Llama-3.1-8B (32 / 8 / 128). One paged K/V cache of
block_size 16, big enough for 256 sequences of 8192 tokens, filled with random values; every
sequence gets random, non-contiguous blocks.

1. Correctness, bf16 unless named: `TritonAttention.forward` (store_kv + decode + prefill
   launches) against `TorchAttention.forward` on the same cache, as ||out - ref|| / ||ref|| over
   all rows (float32); and store_kv bit-exact at slot_mapping. Cases: decode-only batches (1..256
   sequences, contexts 1..8192, with and without split-K), fresh prompts of 2048 and 8192 tokens,
   an extend (512 new on a 3584-token prefix), a mixed batch (decode + extend + fresh) in bf16,
   fp16 and fp32, and a sliding window of 1024.
2. Decode speed: `decode_attention` (+ its reduce) alone, `triton.testing.do_bench` median, by
   batch size and context (all sequences the same length), beside the bandwidth floor: K/V bytes
   read / copy bandwidth, the copy bandwidth measured here as (read + written bytes) / time of a
   1 GiB device-to-device copy. Also the host wall time of a whole `forward` of that batch (store
   + launch planning + launches, synchronised once after 50 calls): the cost a CUDA graph removes.
3. Prefill speed: `prefill_attention` alone on 1 and 4 prompts of 2048 tokens (and an extend),
   beside the FLOP floor: 4 * T^2 * H * D / 2 causal FLOPs a prompt over the bf16 matmul peak
   measured here (8192^3 torch.matmul), and beside torch's SDPA (flash, causal, K/V contiguous and
   repeated to all heads: no paging) on the same prompts.
With --sweep, tile configurations of both kernels at a few points, to choose defaults.

Writes attention_gpu_<device>.json and .png (when matplotlib is importable) into --out; prints a
short table last. Needs a CUDA GPU; on the GPU machines run it from the tree with the Ray bundle
on the path (pydantic for `engine`):

    tar -xJf .raybundle/site.tar.xz -C /tmp && PYTHONPATH=/tmp/site:$PWD python -m bench.attention_gpu --out $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import triton
import torch.nn.functional as F
from triton.testing import do_bench

from bench.common import device_name, device_slug, random_block_tables, synchronize
from engine.attention.base import AttentionMetadata, AttentionSpec
from engine.attention.torch_ref import TorchAttention
from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig, decode_split_plan
from engine.attention.triton_kernels import decode_attention
from engine.attention.triton_prefill import prefill_attention

SHAPES = Path(__file__).resolve().parent / "shapes"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
MODELS = ("qwen3-0.6b", "llama-3.1-8b")
DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
MAX_BATCH, MAX_CONTEXT = 256, 8192
DECODE_BATCHES, DECODE_CONTEXTS = (1, 8, 32, 64, 128, 256), (128, 512, 1024, 2048, 4096, 8192)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 8, 64, 256), (512, 8192)
PREFILL_CASES = (("1 x 2048", [(2048, 2048)]), ("4 x 2048", [(2048, 2048)] * 4), ("extend 512 on 3584", [(512, 4096)]))
SWEEP_PROMPT, SWEEP_DECODE = 2048, ((1, 8192), (64, 2048), (256, 1024))  # --sweep points: prompt; (batch, ctx)
FORWARD_REPS = 50  # whole forwards timed on the host clock
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}  # on ||out - ref|| / ||ref||


def load_spec(model: str) -> AttentionSpec:
    raw = json.loads((SHAPES / model / "config.json").read_text())
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    return AttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5)


class PagedCache:
    """One layer's K/V cache and a random block allocator over it (blocks are reused per case)."""

    def __init__(self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> None:
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.k = torch.randn(shape, dtype=dtype, device=DEVICE, generator=self.gen)
        self.v = torch.randn(shape, dtype=dtype, device=DEVICE, generator=self.gen)
        self.num_blocks = num_blocks

    def batch(self, seqs: list[tuple[int, int]], spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
        """(q, k, v, meta) of a step; seqs: (num_new, seq_len) each; distinct random blocks for all."""
        tables, starts = random_block_tables(seqs, self.num_blocks, BLOCK_SIZE)
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for table, (num_new, seq_len) in zip(tables, seqs) for p in range(seq_len - num_new, seq_len)]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        seq_lens = [seq_len for _, seq_len in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables,
            block_tables_tensor=torch.tensor(padded, dtype=torch.int32, device=DEVICE),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            query_start_loc_tensor=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            max_query_len=max(n for n, _ in seqs),
            max_seq_len=max(seq_lens),
        )
        num_tokens, dtype = starts[-1], self.k.dtype

        def randn(heads: int) -> torch.Tensor:
            return torch.randn(num_tokens, heads, spec.head_dim, dtype=dtype, device=DEVICE, generator=self.gen)

        return randn(spec.num_heads), randn(spec.num_kv_heads), randn(spec.num_kv_heads), meta


# ---- floors of the device
def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read and bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def matmul_peak() -> float:
    """FLOP/s of an 8192^3 bf16 torch.matmul."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


# ---- 1. correctness
def correctness_cases(quick: bool) -> list[tuple[str, list[tuple[int, int]], torch.dtype, int | None]]:
    g = torch.Generator().manual_seed(0)

    def lens(count: int, hi: int) -> list[int]:
        return torch.randint(1, hi + 1, (count,), generator=g).tolist()

    cases = [
        ("decode b1 ctx1", [(1, 1)], torch.bfloat16, None),
        ("decode b1 ctx8192", [(1, 8192)], torch.bfloat16, None),
        ("decode b7 ctx1..8192", [(1, n) for n in lens(7, 8192)] + [(1, 8192)], torch.bfloat16, None),
        ("decode b256 ctx1..2048", [(1, n) for n in lens(256, 2048)], torch.bfloat16, None),
        ("prefill 2048", [(2048, 2048)], torch.bfloat16, None),
        ("extend 512 on 3584", [(512, 4096)], torch.bfloat16, None),
        ("mixed bf16", MIXED, torch.bfloat16, None),
        ("mixed fp16", MIXED, torch.float16, None),
        ("mixed fp32", MIXED, torch.float32, None),
        ("mixed window 1024", MIXED, torch.bfloat16, 1024),
    ]
    if not quick:
        cases += [
            ("decode b64 ctx4096", [(1, 4096)] * 64, torch.bfloat16, None),
            ("prefill 8192", [(8192, 8192)], torch.bfloat16, None),
        ]
    return cases


# decode (ctx 1..8192) + extend (cached prefix) + fresh prompts, one forward
MIXED = [(1, 1), (1, 17), (1, 777), (1, 8192), (1, 3000), (100, 2100), (1000, 1000), (31, 31), (2, 9000), (1, 5)]


def check_case(cache: PagedCache, spec: AttentionSpec, seqs: list[tuple[int, int]]) -> dict[str, Any]:
    q, k, v, meta = cache.batch(seqs, spec)
    num_decode = sum(1 for n, _ in seqs if n == 1)
    got = TritonAttention(spec).forward(q, k, v, cache.k, cache.v, meta)
    flat_k = cache.k.view(-1, spec.num_kv_heads, spec.head_dim)
    flat_v = cache.v.view(-1, spec.num_kv_heads, spec.head_dim)
    stored = bool(torch.equal(flat_k[meta.slot_mapping], k) and torch.equal(flat_v[meta.slot_mapping], v))
    # NOTE: the reference writes the same K/V at the same slots again: it sees the very same cache.
    want = TorchAttention(spec).forward(q, k, v, cache.k, cache.v, meta)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    splits = 1
    if num_decode:
        max_ctx = max(s for n, s in seqs if n == 1)
        splits = decode_split_plan(num_decode, spec.num_kv_heads, max_ctx, _sms(), TritonAttentionConfig())[0]
    return {
        "num_seqs": len(seqs), "num_decode": num_decode, "num_tokens": q.shape[0],
        "max_context": max(s for _, s in seqs), "decode_splits": splits, "rel_err": rel,
        "store_kv_exact": stored, "has_nan": bool(got.isnan().any()),
    }  # fmt: skip


def run_correctness(specs: dict[str, AttentionSpec], quick: bool, seed: int) -> list[dict[str, Any]]:
    rows = []
    for name, spec in specs.items():
        for case, seqs, dtype, window in correctness_cases(quick):
            spec_w = AttentionSpec(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale, window)
            num_blocks = sum(triton.cdiv(s, BLOCK_SIZE) for _, s in seqs) + 8
            cache = PagedCache(num_blocks, spec.num_kv_heads, spec.head_dim, dtype, seed)
            row = {"model": name, "case": case, "dtype": str(dtype).removeprefix("torch."), "window": window}
            row |= check_case(cache, spec_w, seqs)
            row["ok"] = row["rel_err"] < TOLERANCE[dtype] and row["store_kv_exact"] and not row["has_nan"]
            rows.append(row)
            print(f"  {name:13s} {case:24s} {row['dtype']:8s} rel_err {row['rel_err']:.2e} "
                  f"splits {row['decode_splits']:2d} {'ok' if row['ok'] else 'FAIL'}", flush=True)  # fmt: skip
            del cache
    return rows


# ---- 2. decode speed
def _sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def time_decode(
    cache: PagedCache, spec: AttentionSpec, batch: int, context: int, cfg: TritonAttentionConfig
) -> dict[str, Any]:
    q, k, v, meta = cache.batch([(1, context)] * batch, spec)
    out = torch.empty_like(q)
    num_splits, tokens_per_split = decode_split_plan(batch, spec.num_kv_heads, context, _sms(), cfg)

    def launch() -> None:
        decode_attention(
            q, cache.k, cache.v, out, meta.block_tables_tensor, meta.seq_lens_tensor, meta.query_start_loc_tensor,
            scale=spec.scale, sliding_window=None, num_splits=num_splits, tokens_per_split=tokens_per_split,
            max_splits=cfg.max_splits, block_n=cfg.decode_block_n, num_warps=cfg.decode_num_warps,
            num_stages=cfg.decode_num_stages,
        )  # fmt: skip

    ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
    backend = TritonAttention(spec, cfg)
    backend.forward(q, k, v, cache.k, cache.v, meta)
    synchronize(DEVICE)
    start = time.perf_counter()
    for _ in range(FORWARD_REPS):
        backend.forward(q, k, v, cache.k, cache.v, meta)
    synchronize(DEVICE)
    forward_us = (time.perf_counter() - start) / FORWARD_REPS * 1e6
    kv_bytes = 2 * batch * context * spec.num_kv_heads * spec.head_dim * cache.k.element_size()
    return {"batch": batch, "context": context, "num_splits": num_splits, "tokens_per_split": tokens_per_split,
            "kernel_us": ms * 1e3, "kv_bytes": kv_bytes, "forward_wall_us": forward_us}  # fmt: skip


# ---- 3. prefill speed
def time_prefill(
    cache: PagedCache, spec: AttentionSpec, seqs: list[tuple[int, int]], cfg: TritonAttentionConfig, with_sdpa: bool
) -> dict[str, Any]:
    q, k, v, meta = cache.batch(seqs, spec)
    TritonAttention(spec, cfg).forward(q, k, v, cache.k, cache.v, meta)  # stores K/V; compiles
    out = torch.empty_like(q)

    def launch() -> None:
        prefill_attention(
            q, cache.k, cache.v, out, meta.block_tables_tensor, meta.seq_lens_tensor, meta.query_start_loc_tensor,
            scale=spec.scale, sliding_window=None, block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n,
            num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
        )  # fmt: skip

    ms = do_bench(launch, warmup=25, rep=200, return_mode="median")
    # Visible (query, key) pairs: n * prefix + n (n + 1) / 2 a sequence; 4 FLOPs a pair per head dim.
    pairs = sum(n * (s - n) + n * (n + 1) / 2 for n, s in seqs)
    row = {"seqs": seqs, "kernel_us": ms * 1e3, "flops": 4 * pairs * spec.num_heads * spec.head_dim}
    if all(n == s for n, s in seqs):
        row["flops"] = sum(4 * n * n * spec.num_heads * spec.head_dim / 2 for n, _ in seqs)  # the brief's T^2 / 2
    if with_sdpa and len({n for n, _ in seqs}) == 1 and all(n == s for n, s in seqs):
        group = spec.num_heads // spec.num_kv_heads
        n = seqs[0][0]
        qs = q.view(len(seqs), n, spec.num_heads, spec.head_dim).transpose(1, 2)
        ks = k.view(len(seqs), n, spec.num_kv_heads, spec.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        vs = v.view(len(seqs), n, spec.num_kv_heads, spec.head_dim).transpose(1, 2).repeat_interleave(group, 1)
        sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=spec.scale),
                           warmup=25, rep=200, return_mode="median")  # fmt: skip
        row["sdpa_us"] = sdpa_ms * 1e3
    return row


def sweep(cache: PagedCache, spec: AttentionSpec) -> list[dict[str, Any]]:
    rows = []
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = TritonAttentionConfig(prefill_block_m=block_m, prefill_block_n=block_n,
                                                prefill_num_warps=warps, prefill_num_stages=stages)  # fmt: skip
                    try:
                        us = time_prefill(cache, spec, [(SWEEP_PROMPT, SWEEP_PROMPT)], cfg, False)["kernel_us"]
                    except Exception as exc:  # out of shared memory and the like
                        us = None
                        print(f"  prefill {block_m}x{block_n} w{warps} s{stages}: {type(exc).__name__}")
                    rows.append({"kernel": "prefill", "block_m": block_m, "block_n": block_n, "num_warps": warps,
                                 "num_stages": stages, "case": str(SWEEP_PROMPT), "kernel_us": us})  # fmt: skip
    for batch, context in SWEEP_DECODE:
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3):
                    for min_split in (128, 256, 512):
                        if batch * spec.num_kv_heads >= 2 * _sms() and min_split != 256:
                            continue  # no split at this batch: min_split_tokens changes nothing
                        cfg = TritonAttentionConfig(decode_block_n=block_n, decode_num_warps=warps,
                                                    decode_num_stages=stages, min_split_tokens=min_split)  # fmt: skip
                        try:
                            us = time_decode(cache, spec, batch, context, cfg)["kernel_us"]
                        except Exception as exc:
                            us = None
                            print(f"  decode {block_n} w{warps} s{stages}: {type(exc).__name__}")
                        rows.append({"kernel": "decode", "block_n": block_n, "num_warps": warps, "num_stages": stages,
                                     "min_split_tokens": min_split, "case": f"b{batch} ctx{context}",
                                     "kernel_us": us})  # fmt: skip
    return rows


# ---- results
def plot(record: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(record["decode"])
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(6 * (len(models) + 1), 5))
    for ax, model in zip(axes, models):
        rows = record["decode"][model]
        for batch in sorted({r["batch"] for r in rows}):
            pts = [r for r in rows if r["batch"] == batch]
            line = ax.plot([r["context"] for r in pts], [r["kernel_us"] for r in pts], "o-", label=f"batch {batch}")[0]
            ax.plot([r["context"] for r in pts], [r["floor_us"] for r in pts], "--", color=line.get_color(), alpha=0.6)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode attention (us)",
               title=f"{model}: decode (dashed: KV bytes / copy bandwidth)")  # fmt: skip
        ax.legend(fontsize=7)
    ax = axes[-1]
    labels, triton_us, floor_us, sdpa_us = [], [], [], []
    for model, rows in record["prefill"].items():
        for r in rows:
            labels.append(f"{model}\n{r['label']}")
            triton_us.append(r["kernel_us"])
            floor_us.append(r["floor_us"])
            sdpa_us.append(r.get("sdpa_us", 0.0))
    xs = range(len(labels))
    ax.bar([x - 0.27 for x in xs], triton_us, 0.27, label="triton")
    ax.bar(xs, sdpa_us, 0.27, label="torch SDPA (contiguous)")
    ax.bar([x + 0.27 for x in xs], floor_us, 0.27, label="FLOP floor")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="prefill attention (us)", title="prefill")
    ax.legend(fontsize=7)
    env = record["environment"]
    fig.suptitle(f"Triton paged attention, bf16, block_size {BLOCK_SIZE} - {env['device_name']}, torch "
                 f"{env['torch_version']}, triton {env['triton_version']}, {env['date']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_tables(record: dict[str, Any]) -> None:
    worst: dict[str, float] = {}
    for r in record["correctness"]:
        worst[r["dtype"]] = max(worst.get(r["dtype"], 0.0), r["rel_err"])
    failed = [f"{r['model']}/{r['case']}" for r in record["correctness"] if not r["ok"]]
    print(f"\ncorrectness: worst rel_err {', '.join(f'{d} {e:.1e}' for d, e in worst.items())}; "
          f"{'all ok' if not failed else 'FAILED: ' + ', '.join(failed)}")  # fmt: skip
    env = record["environment"]
    print(f"device {env['device_name']}: copy {env['copy_bandwidth_gbs']:.0f} GB/s, bf16 matmul "
          f"{env['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip
    for model, rows in record["decode"].items():
        contexts = sorted({r["context"] for r in rows})
        print(f"\ndecode {model}: kernel us (floor us) [splits]; fwd = host wall us of a whole forward")
        print("batch " + "".join(f"{c:>22d}" for c in contexts))
        for batch in sorted({r["batch"] for r in rows}):
            cells = {r["context"]: r for r in rows if r["batch"] == batch}
            text = "".join(
                f"{cells[c]['kernel_us']:>9.1f} ({cells[c]['floor_us']:6.1f}) [{cells[c]['num_splits']:2d}]"
                for c in contexts
            )
            print(f"{batch:5d} {text}  fwd {cells[contexts[-1]]['forward_wall_us']:.0f}")
    print("\nprefill: kernel us | SDPA us | FLOP floor us | TFLOP/s | % of matmul peak")
    for model, rows in record["prefill"].items():
        for r in rows:
            sdpa = f"{r['sdpa_us']:8.0f}" if "sdpa_us" in r else "       -"
            print(f"  {model:13s} {r['label']:20s} {r['kernel_us']:8.0f} | {sdpa} | {r['floor_us']:8.0f} | "
                  f"{r['tflops']:6.0f} | {100 * r['floor_us'] / r['kernel_us']:5.1f}%")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Folder for the JSON and PNG results.")
    parser.add_argument("--models", default=",".join(MODELS), help="Comma-separated names under bench/shapes.")
    parser.add_argument("--quick", action="store_true", help="Fewer correctness cases and timing points.")
    parser.add_argument("--sweep", action="store_true", help="Also time tile configurations of both kernels.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention_gpu needs a CUDA GPU (the CPU interpreter check is the unit test)")
    torch.manual_seed(args.seed)
    specs = {name: load_spec(name) for name in args.models.split(",")}
    device = DEVICE
    env = {
        "device": str(device), "device_name": device_name(device), "torch_version": torch.__version__,
        "triton_version": triton.__version__, "python_version": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbs": copy_bandwidth() / 1e9, "matmul_tflops": matmul_peak() / 1e12,
    }  # fmt: skip
    record: dict[str, Any] = {
        "benchmark": "attention_gpu", "environment": env, "default_config": TritonAttentionConfig().__dict__
    }
    with torch.inference_mode():
        print("correctness", flush=True)
        record["correctness"] = run_correctness(specs, args.quick, args.seed)
        batches = QUICK_BATCHES if args.quick else DECODE_BATCHES
        contexts = QUICK_CONTEXTS if args.quick else DECODE_CONTEXTS
        record["decode"], record["prefill"], record["sweep"] = {}, {}, {}
        cfg = TritonAttentionConfig()
        for name, spec in specs.items():
            num_blocks = MAX_BATCH * MAX_CONTEXT // BLOCK_SIZE + 8
            cache = PagedCache(num_blocks, spec.num_kv_heads, spec.head_dim, torch.bfloat16, args.seed)
            print(f"decode timing {name}", flush=True)
            rows = []
            for batch in batches:
                for context in contexts:
                    row = time_decode(cache, spec, batch, context, cfg)
                    row["floor_us"] = row["kv_bytes"] / (env["copy_bandwidth_gbs"] * 1e9) * 1e6
                    rows.append(row)
            record["decode"][name] = rows
            print(f"prefill timing {name}", flush=True)
            rows = []
            for label, seqs in PREFILL_CASES:
                row = time_prefill(cache, spec, seqs, cfg, with_sdpa=True)
                row["label"] = label
                row["floor_us"] = row["flops"] / (env["matmul_tflops"] * 1e12) * 1e6
                row["tflops"] = row["flops"] / (row["kernel_us"] * 1e-6) / 1e12
                rows.append(row)
            record["prefill"][name] = rows
            if args.sweep:
                print(f"sweep {name}", flush=True)
                record["sweep"][name] = sweep(cache, spec)
            del cache
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"attention_gpu_{device_slug(device)}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    has_png = plot(record, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if has_png else " (no matplotlib: no PNG)"))
    if args.sweep:
        for name, rows in record["sweep"].items():
            for kernel in ("prefill", "decode"):
                for case in sorted({r["case"] for r in rows if r["kernel"] == kernel}):
                    ok = [r for r in rows if r["kernel"] == kernel and r["case"] == case and r["kernel_us"]]
                    best = min(ok, key=lambda r: r["kernel_us"])
                    print(f"sweep {name} {kernel} {case}: best {best}")
    print_tables(record)
    return record


if __name__ == "__main__":
    main()
