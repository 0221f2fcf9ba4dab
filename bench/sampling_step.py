"""A sampled decode step against a greedy one, unseeded and seeded, in one engine.

1. Decode speed: --batches (1 by default) requests of a --context-token random prompt and
   --max-tokens output tokens (ignore_eos) each, in four modes: greedy (T = 0), sampled (T = 1),
   seeded (T = 1, a seed a request) and truncated (T = 1, top_p 0.9, the sampler's torch path).
   The modes' runs alternate, --repeats times, in one engine with asynchronous scheduling (as
   served). Timed from the step after every request has its first token to the end, the device
   synchronised: ms per decode step (the median run's). Seeded runs must repeat their tokens.
2. The sampler alone: `Sampler.launch` + `finish` of one step's logits [batch, vocab] per mode,
   the device synchronised, microseconds (median of 200); and at batch 1 the host's microseconds
   per call of each piece of a draw (`host_breakdown`).
3. A torch.profiler table per mode at batch 1 (device kernels and host ops), in the log.

--model pair-target: the shape `bench.train_models --size gpu` trains as its target (33M
parameters, vocabulary 8,192), random weights.

    python -m bench.sampling_step --model pair-target --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import base_parser, build_engine, check_no_leak, decode_window, environment, random_prompts
from bench.common import save_plot, synchronize, title, write_results
from engine import EngineCore, SamplingParams
from engine.sampler import SamplingRow

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 1.0},
    "seeded": {"temperature": 1.0},  # a seed a request, added below
    "top_p": {"temperature": 1.0, "top_p": 0.9},
}


def pair_shape_dir(which: str = "target") -> str:
    """A config-only checkpoint directory of bench.train_models' gpu target shape (or its draft's)."""
    from bench.train_models import MAX_POSITIONS, SIZES

    plan = SIZES["gpu"]
    shape = {"target": plan.target, "draft": plan.draft}[which]
    path = Path(tempfile.mkdtemp(prefix=f"pair-{which}-"))
    (path / "config.json").write_text(json.dumps(shape.hf_config(plan.vocab_size, 1, 2, MAX_POSITIONS)))
    return str(path)


def params_for(mode: str, index: int, max_tokens: int) -> SamplingParams:
    seed = {"seed": 7_000 + index} if mode == "seeded" else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **MODES[mode], **seed)


def run(engine: EngineCore, prompts: list[list[int]], mode: str, max_tokens: int, tag: str) -> dict[str, Any]:
    """All requests at once; the decode window's steps and seconds, and each request's tokens."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params_for(mode, i, max_tokens))
    wall, _, num_steps, tokens = decode_window(engine, len(prompts))
    check_no_leak(engine)
    return {"decode_s": wall, "num_steps": num_steps, "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def sampler_alone(engine: EngineCore, batch: int, mode: str, repeats: int) -> float:
    """Median microseconds of one launch + finish on [batch, vocab] logits, device synchronised."""
    vocab = engine.arch.vocab_size
    logits = torch.randn(batch, vocab, device=engine.device, dtype=torch.bfloat16)
    rows = [SamplingRow(params_for(mode, i, 16), [1, 2, 3], [4] * (i % 3)) for i in range(batch)]
    times = []
    for _ in range(repeats + 10):
        synchronize(engine.device)
        start = time.perf_counter()
        engine.sampler.finish(engine.sampler.launch(logits, rows, engine.generator))
        synchronize(engine.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e6


def host_breakdown(engine: EngineCore, repeats: int = 300) -> dict[str, float]:
    """Host microseconds per call of each piece of a batch-1 sampled draw, the device not waited on
    (each piece queued `repeats` times, then one synchronisation outside the clock)."""
    from engine import sampling_kernels
    from engine.pinned import Download, upload

    device, vocab = engine.device, engine.arch.vocab_size
    logits = torch.randn(1, vocab, device=device, dtype=torch.bfloat16)
    draws = torch.tensor([12_345, 0, 0], device=device)
    draws[2:].view(torch.float64).fill_(1.0)  # the row's a, b and its 1 / T's float64 bits (RaceRows' layout)
    token = torch.zeros(1, dtype=torch.long, device=device)
    greedy = [SamplingRow(params_for("greedy", 0, 16), [1, 2, 3], [4])]
    sampled = [SamplingRow(params_for("sampled", 0, 16), [1, 2, 3], [4])]
    seeded = [SamplingRow(params_for("seeded", 0, 16), [1, 2, 3], [4])]
    pieces = {
        "upload one float": lambda: upload([1.0], torch.float32, device),
        "randint": lambda: torch.randint(0, 1 << 62, (1,), device=device, generator=engine.generator),
        "argmax": lambda: logits.argmax(dim=-1),
        "logits.float()": lambda: logits.float(),
        "Download": lambda: Download(token),
        "launch greedy": lambda: engine.sampler.launch(logits, greedy, engine.generator),
        "launch sampled": lambda: engine.sampler.launch(logits, sampled, engine.generator),
        "launch seeded": lambda: engine.sampler.launch(logits, seeded, engine.generator),
    }
    if device.type == "cuda":
        pieces["race kernel (launch)"] = lambda: sampling_kernels.race(logits, draws, 0)
        pieces.update(_launch_pieces(engine, logits, draws))
    out = {}
    for name, piece in pieces.items():
        for _ in range(20):
            piece()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            piece()
        out[name] = (time.perf_counter() - start) / repeats * 1e6
        synchronize(device)
    return out


def _launch_pieces(engine: EngineCore, logits: torch.Tensor, draws: torch.Tensor) -> dict[str, Any]:
    """Diagnostics of the draw's host time: its rows (RaceRows.next of an unchanged row), and the race kernel's
    launch through Triton's launcher against its compiled kernel called directly (the launcher's
    binding and cache lookup skipped: what a cached launch could save)."""
    from engine import draw_keys, sampling_kernels

    race_rows = draw_keys.RaceRows(engine.device)
    out = torch.empty(1, dtype=torch.long, device=engine.device)
    vocab = logits.shape[1]
    chunks = -(-vocab // 8192)
    args = (logits, draws, 0, draws, draws, out, out, out, out, logits.stride(0), 0, vocab, chunks,
            sampling_kernels.torch_threads(vocab, engine.device), 8192, 1024, 1 << (chunks - 1).bit_length(), False)
    grid = (1, chunks, 1)
    pieces: dict[str, Any] = {
        "race rows, a steady batch": lambda: race_rows.next([(None, 1.0, 0)], engine.generator),
        "race kernel launcher": lambda: sampling_kernels._race_kernel[grid](*args),
    }
    try:
        compiled = sampling_kernels._race_kernel[grid](*args)
        compiled[grid](*args)
        pieces["race kernel compiled, called directly"] = lambda: compiled[grid](*args)
    except Exception as error:  # NOTE: the CompiledKernel interface differs between Triton versions
        print(f"direct launch unavailable: {error!r}", flush=True)
    return pieces


def profile_table(engine: EngineCore, prompts: list[list[int]], mode: str, steps: int, top: int) -> str:
    if engine.device.type != "cuda":
        return ""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prof-{mode}-{i}", prompt, params_for(mode, i, 10_000))
    for _ in range(8):
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished():
        engine.step()
    check_no_leak(engine)
    by_host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    by_device = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top)
    return f"{by_host}\n{by_device}"


def plot(record: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        ax = fig.subplots()
        batches = [b["batch"] for b in record["batches"]]
        width = 0.8 / len(MODES)
        for j, mode in enumerate(MODES):
            values = [b["ms_per_step"][mode] for b in record["batches"]]
            bars = ax.bar([i + j * width for i in range(len(batches))], values, width, label=mode)
            for bar, value in zip(bars, values):
                ax.annotate(f"{value:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel("ms per decode step (median run)")
        ax.legend()

    return draw


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=20, help="rows of each profile table; 0 skips them")
    parser.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this result file")
    args = parser.parse_args()
    if args.plot is not None:
        record = json.loads(args.plot.read_text())
        save_plot(args.plot.with_suffix(".png"), plot(record), title(
            "Sampled vs greedy decode step", record["environment"], record["workload"]))
        return
    if args.model == "pair-target":
        args.model = pair_shape_dir()
    batches = [int(b) for b in args.batches.split(",")]
    engine = build_engine(args, max_num_seqs=max(batches))
    vocab = engine.arch.vocab_size
    record: dict[str, Any] = {
        "workload": f"context {args.context}, {args.max_tokens} tokens, {args.repeats} alternated runs a mode",
        "batches": [],
    }
    for batch in batches:
        prompts = random_prompts(batch, args.context, vocab, args.seed + batch)
        run(engine, prompts, "greedy", 8, f"warm{batch}")  # NOTE: compiles the kernels, captures graphs
        for mode in MODES:
            run(engine, prompts, mode, 8, f"warm{batch}-{mode}")
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run(engine, prompts, mode, args.max_tokens, f"b{batch}-{mode}-{r}"))
        ms = {m: statistics.median(x["decode_s"] / max(x["num_steps"], 1) for x in v) * 1e3 for m, v in runs.items()}
        seeded_repeat = all(x["tokens"] == runs["seeded"][0]["tokens"] for x in runs["seeded"])
        row = {
            "batch": batch,
            "ms_per_step": ms,
            "ms_per_step_runs": {m: [x["decode_s"] / max(x["num_steps"], 1) * 1e3 for x in v] for m, v in runs.items()},
            "ratio_to_greedy": {m: ms[m] / ms["greedy"] for m in MODES},
            "best_ms_per_step": {m: min(x["decode_s"] / max(x["num_steps"], 1) for x in v) * 1e3
                                 for m, v in runs.items()},
            "sampler_us": {m: sampler_alone(engine, batch, m, 200) for m in MODES},
            "seeded_runs_repeat_their_tokens": seeded_repeat,
            "seeded_first_tokens": runs["seeded"][0]["tokens"][0][:16],
        }
        print(json.dumps(row, indent=1), flush=True)
        record["batches"].append(row)
        if batch == 1:
            row["host_us"] = host_breakdown(engine)
            print(json.dumps(row["host_us"], indent=1), flush=True)
        if args.top and batch == 1:
            for mode in MODES:
                print(f"==== profile: {mode}, batch 1\n"
                      f"{profile_table(engine, prompts, mode, args.profile_steps, args.top)}",
                      flush=True)
    env = environment(engine, args)
    write_results(args.out, "sampling_step", env, record, plot(record),
                  title("Sampled vs greedy decode step", env, record["workload"]))


if __name__ == "__main__":
    main()
