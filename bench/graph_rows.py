"""When a step of multi-token sequences is faster as one-query graph rows than eagerly.

engine/cuda_graphs.py runs a sequence of n tokens at positions [start, start + n) as n decode rows
in a CUDA graph: no launch overhead, but each row reads its own context (n * (start + n) keys in
all per layer and KV head, where the eager prefill kernel reads each key once per tile of queries).
This measures one forward (the runner's, logits included) both ways, for:

- prompts/chunks: one sequence of n tokens at context `start` (n in --chunk-tokens, start in
  --starts);
- verifications: b sequences of K + 1 = 5 tokens each at context c (b in --verify-batches, c in
  --starts).

Each case: --iters forwards after 3 warm-ups, CUDA synchronised around each; the median. The
graph side lifts the engine's max_multi_row_keys bound, so that the bound itself can be read off
the results (`keys` = the sum of n * (start + n), against graph_ms / eager_ms).

    python -m bench.graph_rows --model bench/shapes/qwen3-0.6b --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.common import base_parser, build_engine, environment, synchronize, title, write_results
from engine.cuda_graphs import DEFAULT_MAX_MULTI_ROW_KEYS
from engine.runner import ForwardSeq, ModelRunner


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _time(runner: ModelRunner, seqs: list[ForwardSeq], iters: int, device: torch.device) -> float:
    for _ in range(3):
        runner.forward(seqs)
    times = []
    for _ in range(iters):
        synchronize(device)
        start = time.perf_counter()
        runner.forward(seqs)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(runner: ModelRunner, seqs: list[ForwardSeq], iters: int, device: torch.device) -> dict[str, Any]:
    graphs = runner.graphs
    assert graphs is not None
    before = graphs.num_replays
    graph_s = _time(runner, seqs, iters, device)
    replayed = graphs.num_replays > before
    runner.graphs = None
    try:
        eager_s = _time(runner, seqs, iters, device)
    finally:
        runner.graphs = graphs
    keys = sum(len(s.token_ids) * (s.start + len(s.token_ids)) for s in seqs if len(s.token_ids) > 1)
    return {
        "rows": sum(len(s.token_ids) for s in seqs),
        "keys": keys,
        "graph_ms": graph_s * 1e3 if replayed else None,
        "eager_ms": eager_s * 1e3,
        "speedup": eager_s / graph_s if replayed else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--chunk-tokens", type=_ints, default=_ints("2,4,8,16,32,64,128,256,512"))
    parser.add_argument("--verify-batches", type=_ints, default=_ints("1,8,32,64"))
    parser.add_argument("--starts", type=_ints, default=_ints("0,512,2048"))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    max_rows = max(max(args.chunk_tokens), 5 * max(args.verify_batches))
    engine = build_engine(args, max_num_seqs=max(args.verify_batches), max_num_batched_tokens=max(max_rows, 2048),
                          cuda_graph_max_rows=max_rows, enable_prefix_caching=False, max_model_len=8192)
    runner = engine.runner
    if runner.graphs is None:
        raise SystemExit("no CUDA graphs on this device/backend: run it on a GPU with the triton backend")
    runner.graphs.max_multi_row_keys = 1 << 62  # measure past the engine's bound
    device, bs = engine.device, engine.pool.block_size
    longest = max(args.starts) + max(max(args.chunk_tokens), 5)
    per_seq = -(-longest // bs)
    blocks = [engine.pool.allocate(per_seq) for _ in range(max(args.verify_batches))]
    vocab = engine.arch.vocab_size
    chunks, verifies = [], []
    for start in args.starts:
        for n in args.chunk_tokens:
            seqs = [ForwardSeq([(7 * i) % vocab for i in range(n)], start, blocks[0], 1)]
            chunks.append({"start": start, "num_tokens": n, **_case(runner, seqs, args.iters, device)})
            print("chunk", chunks[-1], flush=True)
        for b in args.verify_batches:
            seqs = [ForwardSeq([(3 * i + j) % vocab for i in range(5)], start, blocks[j], 5) for j in range(b)]
            verifies.append({"start": start, "batch": b, **_case(runner, seqs, args.iters, device)})
            print("verify", verifies[-1], flush=True)
    for ids in blocks:
        engine.pool.free(ids)
    env = environment(engine, args)
    record = {
        "workload": {"iters": args.iters, "timing": "median of --iters forwards (runner.forward, logits of the "
                     "last row per sequence for chunks, all rows for verifications), CUDA synchronised around each",
                     "engine_max_multi_row_keys": DEFAULT_MAX_MULTI_ROW_KEYS},
        "chunks": chunks,
        "verifications": verifies,
    }

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        for start in args.starts:
            rows = [c for c in chunks if c["start"] == start and c["speedup"]]
            ax1.plot([c["num_tokens"] for c in rows], [c["speedup"] for c in rows], marker="o",
                     label=f"context {start}")
            rows = [v for v in verifies if v["start"] == start and v["speedup"]]
            ax2.plot([v["batch"] for v in rows], [v["speedup"] for v in rows], marker="o", label=f"context {start}")
        for ax, xlabel in ((ax1, "tokens of one sequence"), (ax2, "sequences verifying 5 tokens")):
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("eager ms / graph ms")
            ax.legend()

    paths = write_results(args.out, "graph_rows", env, record, plot,
                          title("One forward: multi-token sequences as graph rows vs eager", env,
                                f"chunks {args.chunk_tokens}, verifications of 5 tokens x {args.verify_batches}, "
                                f"contexts {args.starts}"))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
