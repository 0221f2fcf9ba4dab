"""Where a steady decode step's device time goes beyond its kernels (LAB ONLY): --batch requests decoding at
--context, by turns with asynchronous scheduling (as the offline run steps: the engine's default on CUDA) and
without (--modes): the wall period of --steps consecutive steps, then a torch.profiler trace of --trace-steps of
them (CUDA): the device's busy time (the union of its kernels' and copies' intervals), its activities by time, the
idle gaps between them summed by the pair of activities around them (the longest first), each step's share.

Found (`step_gaps_modes_8b_fp8kv_b512_*`, one H200, FP8 weights and KV, batch 512 from context 1500, 20 steps
a mode then 6 traced): asynchronously a step took 28.2 and 28.6 ms of wall time, its device busy 27.0 and 28.4 ms
of it, idle 0.5 ms (the host keeps ahead); synchronously 39.1 ms, the device idle 11.4 ms of it. The decode
attention kernel took 18.1-19.8 ms of a step in either mode (growing with the context), the FP8 GEMMs 5.6-5.9.

    python -m bench.diag.step_gaps --model bench/shapes/llama-3.1-8b --load-format dummy --quantization fp8 \\
        --kv-cache-dtype fp8 --batch 512 --context 1500 --out DIR
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import torch
from torch.autograd import DeviceType

from bench.common import base_parser, build_engine, device_name, device_slug, synchronize, timed
from bench.profile_step import fill


def trace(engine: Any, num_steps: int, top: int) -> dict[str, Any]:
    """The device's activities over num_steps steps: busy and idle microseconds a step, the gaps by the pair of
    activities around them."""
    # NOTE: device activities alone: recording the host's ops too slows the host, which may open gaps of its own
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        synchronize(engine.device)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start)
    busy, idle, end, prev = 0.0, 0.0, None, None
    by_pair: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for start, stop, name in spans:
        if end is None:
            busy, end, prev = stop - start, stop, name
            continue
        if start > end:
            idle += start - end
            by_pair[(prev[:60], name[:60])].append(start - end)
            busy += stop - start
        elif stop > end:
            busy += stop - end
        if stop >= end:
            end, prev = stop, name
    pairs = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for start, stop, name in spans:
        totals[name[:80]].append(stop - start)
    kinds = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"activities": len(spans), "span_us_a_step": (end - spans[0][0]) / num_steps if spans else 0.0,
            "busy_us_a_step": busy / num_steps, "idle_us_a_step": idle / num_steps,
            "activities_by_time": [{"name": n, "count_a_step": len(t) / num_steps, "us_a_step": sum(t) / num_steps}
                                   for n, t in kinds],
            "gaps": [{"before": a, "after": b, "count_a_step": len(g) / num_steps, "us_a_step": sum(g) / num_steps,
                      "longest_us": max(g)} for (a, b), g in pairs]}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--trace-steps", type=int, default=6)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--quantization", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--modes", default="async,sync,async", help="scheduling of each measured run, in turn")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    engine = build_engine(args, max_num_seqs=args.batch, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype)
    fill(engine, args.batch, args.context, 0.6, random.Random(args.seed))
    for _ in range(20):
        engine.step()
    result: dict[str, Any] = {"batch": args.batch, "context": args.context, "device_name": device_name(engine.device),
                              "modes": []}
    for mode in args.modes.split(","):
        engine.async_scheduling = mode == "async"
        for _ in range(3):
            engine.step()  # NOTE: the first synchronous step reads the asynchronous step in flight
        seconds, _ = timed(engine.device, lambda: [engine.step() for _ in range(args.steps)])
        period = seconds / args.steps
        traced = trace(engine, args.trace_steps, args.top) if engine.device.type == "cuda" else {}
        result["modes"].append({"mode": mode, "period_us": 1e6 * period, **traced})
    print(json.dumps(result, indent=1), flush=True)
    name = f"step_gaps{args.tag}_{device_slug(engine.device)}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
