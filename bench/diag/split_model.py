"""What splitting issue 29's 512 two-worker requests unevenly costs, in an idealised continuous-batching model:
every request there at t=0, one token a step, at most --max-num-seqs running (the rest wait in arrival order for
a seat), a step taking --step-ms-alone plus --step-ms-per-256-rows x rows / 256 (assumed, near the 0.6B shape's
steps on an H200). For each split, --trials random assignments of the 512 requests (bench.offline_throughput's
nano-vllm draw) to two workers; the run lasts as long as the slower worker. Reported: throughput over one model
engine's on the 256-request workload, the median and the worst decile. A model, not a measurement.

    python -m bench.diag.split_model [--splits 256,258,260,265,272]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence


def duration_s(lengths: Sequence[int], max_num_seqs: int, alone_s: float, per_row_s: float) -> float:
    waiting, running, elapsed = list(lengths), [], 0.0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop(0))
        elapsed += alone_s + per_row_s * len(running)
        running = [left - 1 for left in running if left > 1]
    return elapsed


def main() -> None:
    from bench.offline_throughput import nano_vllm_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="256,258,260,265,272")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--step-ms-alone", type=float, default=3.2)
    parser.add_argument("--step-ms-per-256-rows", type=float, default=3.3)
    parser.add_argument("--trials", type=int, default=100)
    args = parser.parse_args()
    alone_s, per_row_s = args.step_ms_alone / 1e3, args.step_ms_per_256_rows / 1e3 / 256
    _, one = nano_vllm_workload(256, 0)
    _, both = nano_vllm_workload(512, 0)
    one_rate = sum(one) / duration_s(one, args.max_num_seqs, alone_s, per_row_s)
    rng = random.Random(1)
    rows = []
    for split in (int(s) for s in args.splits.split(",")):
        rates = []
        for _ in range(args.trials):
            order = list(range(len(both)))
            rng.shuffle(order)
            slower = max(duration_s([both[i] for i in part], args.max_num_seqs, alone_s, per_row_s)
                         for part in (order[:split], order[split:]))
            rates.append(sum(both) / slower / one_rate)
        rates.sort()
        rows.append({"split": f"{split}/{len(both) - split}", "x_one_engine_median": rates[len(rates) // 2],
                     "x_one_engine_worst_decile": rates[len(rates) // 10]})
    print(json.dumps({"model": vars(args), "splits": rows}))


if __name__ == "__main__":
    main()
