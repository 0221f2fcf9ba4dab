"""Where the host's time goes in a batch-1 decode step, greedy against sampled (T = 1) and seeded: a
cProfile of --steps engine steps per mode, one request decoding, its functions by own time and a few
by cumulative time, and the wall time a step without the profiler. The engine and model as in
bench.sampling_step (--model pair-target: that target's shape, random weights).

    python -m bench.diag.step_host_profile --model pair-target --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import time

from bench.common import base_parser, build_engine, random_prompts, synchronize
from bench.sampling_step import pair_shape_dir, params_for
from engine import EngineCore

MODES = ("greedy", "sampled", "seeded")


def steps(engine: EngineCore, mode: str, count: int, tag: str, profile: cProfile.Profile | None) -> float:
    """Seconds a step over `count` steps of one request decoding (after 10 unmeasured ones)."""
    prompt = random_prompts(1, 256, engine.arch.vocab_size, 1)[0]
    engine.add_request(tag, prompt, params_for(mode, 0, count + 40))
    for _ in range(10):
        engine.step()
    synchronize(engine.device)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    for _ in range(count):
        engine.step()
    if profile is not None:
        profile.disable()
    synchronize(engine.device)
    elapsed = (time.perf_counter() - start) / count
    engine.abort_request(tag)
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    return elapsed


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.model == "pair-target":
        args.model = pair_shape_dir()
    engine = build_engine(args, max_num_seqs=4)
    out = {}
    for mode in MODES:
        steps(engine, mode, 50, f"warm-{mode}", None)
    for r in range(3):
        for mode in MODES:
            out.setdefault(mode, []).append(steps(engine, mode, args.steps, f"{mode}-{r}", None) * 1e6)
    print(json.dumps({"us_a_step": out}, indent=1), flush=True)
    for mode in MODES:
        profile = cProfile.Profile()
        per_step = steps(engine, mode, args.steps, f"prof-{mode}", profile) * 1e6
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        print(f"===== {mode}: {per_step:.1f} us a step under the profiler, {args.steps} steps", flush=True)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
