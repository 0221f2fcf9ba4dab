"""Each worker's state over a goodput run, read from the router's /metrics every second: its role
(prefill, decode, decode_every_prompt), requests running and waiting, KV use, prompt tokens queued, its
engine's measured decode step (ms) and prefill rate (tokens/s), which the autoscaler's pressures read, and
where its engine thread's time went (steps, seconds in steps and in commands, the CUDA allocator's retries
and frees, all since start; `engine_use` takes their differences). The adaptive mode's autoscaler moves
workers between roles while the rates run; this is what shows when, and what each worker carried before
and after (bench.goodput records it per mode, bench/rate_step.py scores roles).
"""

from __future__ import annotations

import asyncio
import http.client
import re
import time
from collections.abc import Callable
from typing import Any

from bench.server_process import scrape_metrics

# series -> (the field it fills, its value as kept); pdserve:worker_role is read apart (its role is a label)
_GAUGES: dict[str, tuple[str, Callable[[float], Any]]] = {
    "pdserve:num_requests_running": ("running", int),
    "pdserve:num_requests_waiting": ("waiting", int),
    "pdserve:kv_cache_usage_perc": ("kv", lambda x: round(x, 3)),
    "pdserve:num_queued_prompt_tokens": ("queued_tokens", int),
    "pdserve:decode_step_seconds": ("decode_step_ms", lambda x: round(x * 1e3, 2)),
    "pdserve:prefill_tokens_per_second": ("prefill_tok_s", int),
    # since start: differences between samples give steps a second and the engine thread's busy share
    "pdserve:engine_steps": ("steps", int),
    "pdserve:engine_step_seconds": ("step_s", lambda x: round(x, 3)),
    "pdserve:engine_command_seconds": ("command_s", lambda x: round(x, 3)),
    "pdserve:engine_longest_recent_step_seconds": ("longest_step_ms", lambda x: round(x * 1e3, 1)),
    "pdserve:cuda_alloc_retries": ("alloc_retries", int),
    "pdserve:cuda_device_frees": ("device_frees", int),
    "pdserve:engine_step_device_seconds": ("device_s", lambda x: round(x, 3)),
    "pdserve:engine_step_wait_seconds": ("wait_s", lambda x: round(x, 3)),
    "pdserve:rank_forward_seconds": ("rank_forward_s", lambda x: round(x, 3)),
    "pdserve:rank_call_seconds": ("rank_call_s", lambda x: round(x, 3)),
    "pdserve:rank_longest_recent_call_seconds": ("rank_longest_call_ms", lambda x: round(x * 1e3, 1)),
    "pdserve:gc_pause_seconds": ("gc_s", lambda x: round(x, 3)),
    "pdserve:gc_longest_recent_pause_seconds": ("gc_longest_ms", lambda x: round(x * 1e3, 1)),
    "pdserve:rank_gc_pause_seconds": ("rank_gc_s", lambda x: round(x, 3)),
    "pdserve:rank_gc_longest_recent_pause_seconds": ("rank_gc_longest_ms", lambda x: round(x * 1e3, 1)),
}
_SERIES = re.compile(r"^(pdserve:\w+)\{([^}]*)\} (\S+)$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def worker_states(metrics_text: str) -> dict[str, dict[str, Any]]:
    """{worker: {"role", "running", "waiting", "kv", "queued_tokens", "decode_step_ms", "prefill_tok_s", "steps",
    "step_s", "command_s", "longest_step_ms", "alloc_retries", "device_frees", "device_s", "wait_s",
    "rank_forward_s", "rank_call_s", "rank_longest_call_ms", "gc_s", "gc_longest_ms", "rank_gc_s",
    "rank_gc_longest_ms"}} from a /metrics page (a field the page lacks is absent)."""
    out: dict[str, dict[str, Any]] = {}
    for name, labels, value in _SERIES.findall(metrics_text):
        pairs = dict(_LABEL.findall(labels))
        worker = pairs.get("worker")
        if worker is None:
            continue
        if name == "pdserve:worker_role":
            if float(value) == 1.0 and "role" in pairs:
                out.setdefault(worker, {})["role"] = pairs["role"]
        elif name in _GAUGES:
            field, convert = _GAUGES[name]
            out.setdefault(worker, {})[field] = convert(float(value))
    return out


def role_changes(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples at which a worker's role changed: [{"t_s", "roles": {worker: role}}]. A worker whose role a
    sample lacks (its stats did not answer that scrape) keeps the role it had."""
    out: list[dict[str, Any]] = []
    for sample in timeline:
        last = out[-1]["roles"] if out else {}
        roles = {w: s.get("role", last.get(w)) for w, s in sample["workers"].items()}
        roles = {w: r for w, r in roles.items() if r is not None}
        if roles and roles != last:
            out.append({"t_s": sample["t_s"], "roles": roles})
    return out


# engine_use's figures: a share of the interval -> the since-start seconds it is the difference of; the
# longest-recent figures as sampled; counts as differences
_SHARE_OF = {"step_share": "step_s", "device_share": "device_s", "wait_share": "wait_s", "command_share": "command_s",
             "rank_forward_share": "rank_forward_s", "rank_call_share": "rank_call_s", "gc_share": "gc_s",
             "rank_gc_share": "rank_gc_s"}
_LONGEST = ("longest_step_ms", "rank_longest_call_ms", "gc_longest_ms", "rank_gc_longest_ms")
_COUNTS = ("alloc_retries", "device_frees")
_COLUMNS = (("t_s", "6.1f"), ("running", "4d"), ("steps_per_s", "7.2f"), ("step_share", "6.3f"),
            ("command_share", "6.3f"), ("device_share", "6.3f"), ("alloc_retries", "4d"), ("device_frees", "4d"),
            ("longest_step_ms", "7.1f"), ("wait_share", "6.3f"), ("rank_forward_share", "6.3f"),
            ("rank_call_share", "6.3f"), ("rank_longest_call_ms", "7.1f"), ("gc_share", "6.3f"),
            ("gc_longest_ms", "7.1f"), ("rank_gc_share", "6.3f"), ("rank_gc_longest_ms", "7.1f"))  # printed, in order


def engine_use(timeline: list[dict[str, Any]], worker: str) -> list[dict[str, Any]]:
    """Between consecutive samples that have `worker`'s engine counters: its steps a second, the shares of the
    wall time its engine thread spent in steps and in commands, the GPU's busy share (its steps' device time;
    where a worker does not report it, steps a second x decode_step_ms, the median step), the share its engine
    thread waited for tokens inside steps (what the step share leaves beside it is the host's own work), the
    other ranks' shares launching forwards and moving KV, the shares its process's and the other ranks'
    garbage collectors paused, and the allocator's retries and frees in between, with its longest recent
    step, the other ranks' longest recent KV move and both longest recent collector pauses as sampled. A
    worker that restarted (its counters went back) starts afresh."""
    out: list[dict[str, Any]] = []
    last: tuple[float, dict[str, Any]] | None = None
    for sample in timeline:
        now = sample["workers"].get(worker, {})
        if "steps" not in now or "step_s" not in now:
            continue
        if last is not None and now["steps"] >= last[1]["steps"] and sample["t_s"] > last[0]:
            dt, before = sample["t_s"] - last[0], last[1]
            steps_per_s = (now["steps"] - before["steps"]) / dt

            def share(field: str) -> float:
                return round((now.get(field, 0.0) - before.get(field, 0.0)) / dt, 3)

            row: dict[str, Any] = {"t_s": sample["t_s"], "running": now.get("running", 0),
                                   "steps_per_s": round(steps_per_s, 2)}
            row.update({name: share(counter) for name, counter in _SHARE_OF.items()})
            if "device_s" not in now:  # NOTE: a worker from before every step's device time was reported
                row["device_share"] = round(steps_per_s * now.get("decode_step_ms", 0.0) / 1e3, 3)
            row.update({name: now.get(name, 0.0) for name in _LONGEST})
            row.update({name: now.get(name, 0) - before.get(name, 0) for name in _COUNTS})
            out.append(row)
        last = (sample["t_s"], now)
    return out


RUNNING_BANDS = ((1, 5), (6, 11), (12, 10**9))  # sequences running: few, some, many
_SHARES = ("steps_per_s", *_SHARE_OF)


def summarize(use: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """engine_use's intervals by sequences running (RUNNING_BANDS; intervals with none left out): how many, the
    median of each rate and share, and the largest of each longest-recent figure; bands without intervals
    are left out."""
    import statistics

    out = []
    for lo, hi in RUNNING_BANDS:
        rows = [u for u in use if lo <= u["running"] <= hi]
        if not rows:
            continue
        band: dict[str, Any] = {"running": f"{lo}-{hi}" if hi < 10**9 else f"{lo}+", "intervals": len(rows)}
        band.update({k: round(statistics.median(u.get(k, 0.0) for u in rows), 3) for k in _SHARES})
        band.update({k: max(u.get(k, 0.0) for u in rows) for k in _LONGEST})
        out.append(band)
    return out


async def poll_workers(server_url: str, out: list[dict[str, Any]], started: float, interval_s: float = 1.0) -> None:
    """Until cancelled, every interval: {"t_s": seconds since STARTED (perf_counter), "workers": worker_states}
    appended to OUT. A scrape that fails or times out is skipped; the next one tries again."""
    while True:
        try:
            workers = await asyncio.to_thread(lambda: worker_states(scrape_metrics(server_url, timeout_s=5.0)))
            if workers:
                out.append({"t_s": round(time.perf_counter() - started, 1), "workers": workers})
        except (OSError, ValueError, http.client.HTTPException):  # NOTE: urllib's short reads are none of the others
            pass
        await asyncio.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    """python -m bench.worker_timeline RESULT.json [MODE ...]: each worker's engine use over a bench.goodput run
    (engine_use per sample), by mode; the modes' KV pushes beside them."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("result", type=Path)
    parser.add_argument("modes", nargs="*", help="default: every mode of the run")
    parser.add_argument("--summary", action="store_true", help="each worker's intervals by sequences running "
                        "(medians, largest longest-recent figures) instead of every interval")
    args = parser.parse_args(argv)
    run = json.loads(args.result.read_text())
    for mode, data in run["modes"].items():
        if args.modes and mode not in args.modes:
            continue
        timeline = data.get("timeline", [])
        workers = sorted({w for sample in timeline for w in sample["workers"]})
        print(f"== {mode}: phases {data.get('phases_s')}; pushes {data.get('pushes')}")
        for worker in workers:
            if args.summary:
                print(f"  {worker}: running intervals " + " ".join(_SHARES + _LONGEST))
                for band in summarize(engine_use(timeline, worker)):
                    print(f"    {band['running']:>6} {band['intervals']:4d} "
                          + " ".join(f"{band[k]:.3f}" for k in _SHARES) + " "
                          + " ".join(f"{band[k]:.1f}" for k in _LONGEST))
                continue
            print(f"  {worker}: " + " ".join(name for name, _ in _COLUMNS))
            for u in engine_use(timeline, worker):
                print("    " + " ".join(format(u[name], spec) for name, spec in _COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
