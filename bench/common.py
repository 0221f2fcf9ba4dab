"""Helpers the benchmarks share: the common command line, building an engine from it, naming the
device, random prompts, a synchronised clock, the leak check, and writing the JSON and PNG.

Knows nothing of any one benchmark's workload: each benchmark passes its own workload, results,
plot and title line, and this module adds the environment (device, torch, date, model shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from engine import EngineCore, engine_config
from engine.config import DEFAULT_MODEL
from loadgen.report import cpu_name

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results"


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes; each adds its own workload sizes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="default", help="HF checkpoint directory, or 'default' (embedded model).")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="'dummy': random weights.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu', or 'cuda[:N]'.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Folder for the JSON and PNG results.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random prompts and of dummy weights.")
    parser.add_argument("--quick", action="store_true", help="A smaller workload, for a fast look.")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads (default: torch's own); 1 on a busy machine."
    )
    return parser


def build_engine(args: argparse.Namespace, **options: Any) -> EngineCore:
    """The engine the command line asks for; sets torch's CPU thread count (process-wide) if given."""
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
        torch.set_num_threads(args.num_threads)
    return EngineCore(
        engine_config(
            args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed, **options
        )
    )


# ---- the device and the clock
def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def device_slug(device: torch.device) -> str:
    """'cpu', or the GPU's name in lower case with dashes: 'nvidia-h100-80gb-hbm3'."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def machine_tag(device: str) -> str:
    """A result file's suffix naming the machine: 'cpu', or the GPU count and slug ('2xnvidia-h200')."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.device_count()}x{device_slug(torch.device('cuda'))}"


def free_device_memory() -> None:
    """Gives the GPU back what dropped engines held. An engine's parts refer to each other, so `del` alone
    leaves its KV cache to the cycle collector: a server started next in this process's GPU ran out of
    memory (126 of 140 GiB still held)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `fn` takes, with the device's queued work finished at both ends; and its result."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def graph_seconds(fn: Callable[[], Any], device: torch.device, count: int) -> float:
    """Device time of `count` calls of `fn` captured in one CUDA graph (after 3 eager calls on the
    capture stream): the median of 10 replays, 3 more discarded."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(count):
            fn()
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:])


def add_child_arguments(parser: argparse.ArgumentParser, value_type: Callable[[str], object] = str) -> None:
    """The arguments `run_in_processes` gives each child: --one VALUE and --one-out FILE (hidden)."""
    parser.add_argument("--one", type=value_type, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-out", default=None, help=argparse.SUPPRESS)


def finish_child(one_out: str, record: dict[str, Any], cleanup: Callable[[], None] | None = None) -> None:
    """The end of a `run_in_processes` child: its record to one_out as JSON, then (after `cleanup`) the process
    gone at once. NOTE: os._exit: the figures are written; no teardown may hold them back."""
    Path(one_out).write_text(json.dumps(record))
    sys.stdout.flush()
    if cleanup is not None:
        cleanup()
    os._exit(0)


def run_in_processes(module: str, values: Sequence[object], timeout_s: float) -> list[dict[str, Any]]:
    """For each value, one after another: `python -m module <this process's arguments> --one VALUE
    --one-out FILE` in a process of its own (so one run's memory never crowds the next); the JSON
    records the children wrote to FILE, in order."""
    records = []
    for value in values:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, "-m", module, *sys.argv[1:], "--one", str(value), "--one-out", f.name],
                           check=True, timeout=timeout_s)
            records.append(json.loads(Path(f.name).read_text()))
    return records


# ---- workloads
def random_prompts(num_prompts: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of uniformly random token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(num_tokens)] for _ in range(num_prompts)]


def random_block_tables(seqs: Sequence[tuple[int, int]], num_blocks: int,
                        block_size: int) -> tuple[list[list[int]], list[int]]:
    """A step's paged layout for the attention labs: each sequence (new tokens, context) its own distinct random
    blocks of num_blocks (drawn the same for the same count of sequences), and the step's query start offsets."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(seqs))).tolist()
    if sum(-(-seq_len // block_size) for _, seq_len in seqs) > num_blocks:
        raise ValueError(f"the step needs more than the cache's {num_blocks} blocks")
    tables, starts = [], [0]
    for num_new, seq_len in seqs:
        tables.append([order.pop() for _ in range(-(-seq_len // block_size))])
        starts.append(starts[-1] + num_new)
    return tables, starts


def decode_window(engine: EngineCore, num_requests: int) -> tuple[float, int, int, dict[str, list[int]]]:
    """Steps the engine until done. The decode window starts at the step after every one of its
    `num_requests` requests has its first token (device synchronised): (its seconds, tokens decoded
    in it, its steps, every request's tokens by id)."""
    tokens: dict[str, list[int]] = {}
    start = None
    num_tokens = num_steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if start is None:
            if len(tokens) == num_requests:
                synchronize(engine.device)
                start = time.perf_counter()
            continue
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
        num_steps += 1
    synchronize(engine.device)
    if start is None:
        raise RuntimeError(f"only {len(tokens)} of {num_requests} requests produced a token")
    return time.perf_counter() - start, num_tokens, num_steps, tokens


def check_no_leak(engine: EngineCore) -> None:
    """Raises if a request is still live or a KV block is still held after a run."""
    engine.check_integrity()
    if engine.has_unfinished() or engine.pool.num_held_blocks:
        raise RuntimeError(
            f"engine not idle after the run: unfinished={engine.has_unfinished()}, "
            f"held blocks={engine.pool.num_held_blocks}"
        )


# ---- results
def model_label(model: str | Path) -> str:
    """How results name a model: 'default' as it is; a directory (resolved against the working
    directory) relative to the repository when inside it ('bench/shapes/qwen3-0.6b'), else by its
    own name ('qwen3-0.6b'). Never an absolute path: that names one checkout on one machine."""
    if str(model) == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(model).resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name


def environment(engine: EngineCore, args: argparse.Namespace) -> dict[str, Any]:
    """Where and on what a benchmark ran: device, software, date, and the model's shape."""
    arch = engine.arch
    return {
        "device": str(engine.device),
        "device_name": device_name(engine.device),
        "num_cpu_threads": torch.get_num_threads(),
        "num_cpus": os.cpu_count(),
        # 1, 5 and 15 minute load averages as the results are written: other work on the machine
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "kv_cache": {"num_blocks": engine.pool.num_blocks, "block_size": engine.pool.block_size},
        "model": {
            "name": model_label(args.model),
            "dir": model_label(engine.model_dir),
            "load_format": args.load_format,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "architecture": arch.architecture,
            "num_layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size,
            "num_heads": arch.num_heads,
            "num_kv_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim,
            "vocab_size": arch.vocab_size,
            "num_params": arch.num_params,
        },
    }


def title(bench_title: str, env: dict[str, Any], workload_line: str) -> str:
    """Four lines: what, which model (shape, dtype), where (device, torch, date), and the workload."""
    m = env["model"]
    # NOTE: results written before model_label may hold an absolute path; a relative one is kept as written
    name = model_label(m["name"]) if Path(m["name"]).is_absolute() else m["name"]
    shape = (
        f"{m['num_layers']}L h{m['hidden_size']} ffn{m['intermediate_size']} "
        f"{m['num_heads']}q/{m['num_kv_heads']}kv x{m['head_dim']} V{m['vocab_size']}, "
        f"{m['num_params'] / 1e6:.2f}M params"
    )
    return (
        f"{bench_title}\n"
        f"model {name} ({m['architecture']}: {shape}), {m['dtype']}, {m['load_format']} weights\n"
        f"{env['device_name']} ({env['device']}), torch {env['torch_version']}, {env['date']}\n"
        f"{workload_line}"
    )


def write_results(
    out_dir: Path, bench: str, env: dict[str, Any], record: dict[str, Any], plot: Callable[[Any], None], plot_title: str
) -> tuple[Path, Path]:
    """Writes `<bench>_<device slug>.json` (env + record) and `.png` (drawn by `plot(fig)`).
    The JSON is written first: where matplotlib is missing (the GPU machines), only it is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{bench}_{device_slug(torch.device(env['device']))}"
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps({"benchmark": bench, "environment": env, **record}, indent=2) + "\n")
    if not save_plot(png_path, plot, plot_title):
        print(f"matplotlib is not installed: wrote {json_path} without its plot")
    return json_path, png_path


def save_plot(png_path: Path, plot: Callable[[Any], None], plot_title: str) -> bool:
    """Draws `plot(fig)` under PLOT_TITLE into PNG_PATH; False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 6.5))
    plot(fig)
    fig.suptitle(plot_title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.87))
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


def label_bars(ax: Any, bars: Any, values: Sequence[float], fmt: str) -> None:
    for bar, value in zip(bars, values):
        ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
