"""A queue of prompts prefilled as a serving engine does it (chunked at the step budget, chunks of
several prompts packed into a step) against what the planner's step profile says the same tokens
cost: the profile's fresh-prompt step time of the budget, once per budget of tokens ("packed"), and
each prompt alone in budget-sized chunks without their context ("alone"). Random token ids; the
first tokens only (max_tokens 1).

    python -m bench.prefill_queue --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16 \\
        --profile bench/results/planner_profile_llama-3.1-8b_nvidia-h200.json [--async-scheduling]
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import base_parser, build_engine, environment, synchronize, write_results
from cluster.planner import StepProfile
from engine import EngineCore, SamplingParams

MIXES = ((1000, 2000), (1000, 4000), (2048, 2048))  # prompt lengths, uniform between
PROMPTS = 24


def prefill(engine: EngineCore, lengths: list[int], tag: str, rng: random.Random) -> tuple[float, int]:
    """Milliseconds and steps until every prompt's first token."""
    vocab = engine.arch.vocab_size
    for i, n in enumerate(lengths):
        engine.add_request(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(max_tokens=1, temperature=0.0))
    synchronize(engine.device)
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    synchronize(engine.device)
    return (time.perf_counter() - started) * 1e3, steps


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    profile = StepProfile.model_validate_json(args.profile.read_text())
    budget = profile.max_num_batched_tokens
    engine = build_engine(args, max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=4300,
                          async_scheduling=args.async_scheduling)
    rng = random.Random(args.seed)
    prefill(engine, [budget] * 4, "warm-up", rng)
    alone = statistics.median(prefill(engine, [budget], f"one-{r}", rng)[0] for r in range(5))
    record: dict[str, Any] = {"async_scheduling": args.async_scheduling, "budget": budget,
                              "one_budget_prompt_ms": alone, "profile_budget_ms": profile.prefill_step_ms(budget),
                              "context_ms_per_pair": profile.context_ms_per_pair, "mixes": []}
    print(f"one {budget}-token prompt alone: {alone:.1f} ms (profile {profile.prefill_step_ms(budget):.1f})")
    for lo, hi in MIXES:
        lengths = [rng.randint(lo, hi) for _ in range(PROMPTS)]
        total = sum(lengths)
        packed = total / budget * profile.prefill_step_ms(budget)
        without_context = sum(sum(profile.prefill_step_ms(min(budget, n - c)) for c in range(0, n, budget))
                              for n in lengths)
        with_context = sum(profile.prompt_ms(n) for n in lengths)
        ms, steps = prefill(engine, lengths, f"queue-{lo}-{hi}", rng)
        row = {"lengths": [lo, hi], "prompts": PROMPTS, "tokens": total, "ms": ms, "steps": steps,
               "profile_packed_ms": packed, "profile_alone_ms": without_context,
               "profile_with_context_ms": with_context}
        record["mixes"].append(row)
        print(f"{PROMPTS} prompts of {lo}-{hi} tokens ({total}): {ms:.0f} ms in {steps} steps, "
              f"{total / ms:.1f}k tok/s; x{ms / packed:.3f} the profile packed, x{ms / without_context:.3f} alone, "
              f"x{ms / with_context:.3f} alone with the context term", flush=True)
    env = environment(engine, args)
    engine.close()

    def plot(fig: Any) -> None:
        ax = fig.subplots()
        labels = [f"{r['lengths'][0]}-{r['lengths'][1]}" for r in record["mixes"]]
        for i, (key, label) in enumerate((("ms", "measured"), ("profile_packed_ms", "profile, packed"),
                                          ("profile_with_context_ms", "profile with context"))):
            ax.bar([x + 0.27 * i for x in range(len(labels))], [r[key] for r in record["mixes"]], 0.27, label=label)
        ax.set_xticks([x + 0.27 for x in range(len(labels))], labels)
        ax.set_xlabel(f"prompt tokens ({PROMPTS} prompts)")
        ax.set_ylabel("ms to every first token")
        ax.legend()

    name = "prefill_queue_async" if args.async_scheduling else "prefill_queue"
    json_path, _ = write_results(args.out, name, env, {"profile": str(args.profile), **record}, plot,
                                 f"a queue of prompts against the step profile ({env['device_name']})")
    print(f"wrote {json_path}")

if __name__ == "__main__":
    main()
