"""The decode worker's own CPU per streamed token, without a GPU or Ray: a real DecodeWorker (the
embedded tiny model on the CPU, one torch thread) in this process, fed as a router feeds it: every
one of --streams requests `submit`ted at once, then one poller that calls `poll` and decodes each
TokenBatchMsg, as router/dispatch.py's `_poll` does, until every stream has its --max-tokens.

Reported per run, in microseconds of CPU per streamed token:

- `engine_step_us`: the engine thread inside `EngineCore.step` (the engine's own work);
- `engine_handoff_us`: the engine thread outside `step`: handing each step's outputs to the event
  loop, running commands between steps;
- `event_loop_us`: the event loop thread (the actor's asyncio loop): delivering outputs to the
  outboxes, `poll`, encoding TokenBatchMsg, `submit` (`event_loop_submit_us` of it: until every
  `submit` has returned); the router's side, decoding and reading each batch on the same thread
  here, is timed apart (`router_side_us`) and left out;
- `worker_overhead_us`: the two before, the worker's CPU that is not engine step time. On a GPU,
  where the step is host-bound and this all shares one GIL with it, that is the time taken from
  the engine (bench/http_vs_offline.py's worker at 1.06 cores);
- `gc_us`: the garbage collector's passes, on any thread (already inside the figures above, on
  the thread each ran on; `full_gcs` counts the full ones, which scan every object of the process).

Also the steps, the polls and the event loop's wake-ups from the engine thread. A poll here costs
no Ray call, so each step's outputs are polled at once (one poll a step, as a busy worker sees).
Run to run the figures move by a few tenths of a microsecond (and a full collection lands on any
thread): compare medians of several repeats.
--profile prints the event loop thread's cProfile (thread CPU), top 25 by own time.
--freeze-gc builds the worker with DecodeWorkerConfig.freeze_gc, as a Ray actor has it.

--out FILE writes every run and the medians as JSON, with the machine and the command.

    python -m bench.worker_cpu --streams 256 --max-tokens 200 --repeats 5 [--freeze-gc] [--profile] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import platform
import pstats
import random
import statistics
import threading
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.messages import GenerateRequestMsg, TokenBatchMsg


def _thread_cpu_s(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


class _StepTimer:
    """Wraps the engine's `step` (called on the engine thread) to add up its thread CPU seconds."""

    def __init__(self, step: Callable[[], Any]) -> None:
        self.step, self.cpu_s, self.num_steps = step, 0.0, 0

    def __call__(self) -> Any:
        started = time.thread_time()
        try:
            return self.step()
        finally:
            self.cpu_s += time.thread_time() - started
            self.num_steps += 1


class _GcTimer:
    """A gc.callbacks entry: the CPU seconds of the collector's passes, on whichever thread they ran."""

    def __init__(self) -> None:
        self.cpu_s, self.num_full = 0.0, 0
        self._started: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started[threading.get_ident()] = time.thread_time()
            return
        self.cpu_s += time.thread_time() - self._started.pop(threading.get_ident())
        self.num_full += info["generation"] == 2


async def run(
    streams: int, max_tokens: int, prompt_len: int, seed: int, freeze_gc: bool, profile: bool
) -> dict[str, Any]:
    block_size = 16
    num_blocks = streams * (-(-(prompt_len + max_tokens + 1) // block_size)) + 16
    worker = DecodeWorker(
        DecodeWorkerConfig(
            worker_id="d0", transport="local", freeze_gc=freeze_gc,
            engine=engine_config(device="cpu", block_size=block_size, num_blocks=num_blocks, max_num_seqs=streams,
                                 max_num_batched_tokens=max(2048, streams * prompt_len), seed=seed),
        ),
        transport_options={"hub": LocalHub()},
    )
    engine = worker.loop.engine
    timer = _StepTimer(engine.step)
    engine.step = timer  # type: ignore[method-assign]
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True, seed=seed)
    requests = [
        GenerateRequestMsg(request_id=f"r{i}", prompt_token_ids=[rng.randrange(4, 2000) for _ in range(prompt_len)],
                           params=params, router_id="router").encode()
        for i in range(streams)
    ]
    engine_ident = worker.loop._thread.ident
    assert engine_ident is not None
    aio = asyncio.get_running_loop()
    call_soon_threadsafe = aio.call_soon_threadsafe
    num_wakeups = 0

    def counting_call_soon_threadsafe(*args: Any, **kwargs: Any) -> Any:  # the engine thread's hand-offs
        nonlocal num_wakeups
        num_wakeups += threading.get_ident() == engine_ident
        return call_soon_threadsafe(*args, **kwargs)

    aio.call_soon_threadsafe = counting_call_soon_threadsafe  # type: ignore[method-assign]
    gc_timer = _GcTimer()
    gc.callbacks.append(gc_timer)
    profiler = cProfile.Profile(time.thread_time) if profile else None  # CPU, not wall: the GIL waits left out
    num_tokens = num_finished = num_polls = 0
    router_s = 0.0  # the router's side, on this thread: decoding and reading each batch
    started_wall, started_loop, started_engine = time.perf_counter(), time.thread_time(), _thread_cpu_s(engine_ident)
    started_step = timer.cpu_s
    if profiler:
        profiler.enable()
    await asyncio.gather(*(worker.submit(r) for r in requests))
    submit_s = time.thread_time() - started_loop
    num_wakeups = 0  # NOTE: the admissions' replies count no more: from here on, the steps' hand-offs
    while num_finished < streams:
        raw = await worker.poll("router", 1.0)
        num_polls += 1
        t = time.thread_time()
        for out in TokenBatchMsg.decode(raw).outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            num_tokens += len(out.new_token_ids)
            num_finished += out.finish_reason is not None
        router_s += time.thread_time() - t
    if profiler:
        profiler.disable()
    gc.callbacks.remove(gc_timer)
    wall = time.perf_counter() - started_wall
    loop_s = time.thread_time() - started_loop - router_s
    engine_s = _thread_cpu_s(engine_ident) - started_engine
    step_s = timer.cpu_s - started_step
    assert num_tokens == streams * max_tokens, f"{num_tokens} tokens streamed, {streams * max_tokens} expected"
    assert await worker.check_integrity() == 0
    await worker.shutdown()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    per_token = 1e6 / num_tokens
    return {
        "streams": streams, "max_tokens": max_tokens, "prompt_len": prompt_len, "tokens": num_tokens,
        "wall_s": wall, "steps": timer.num_steps, "polls": num_polls, "wakeups": num_wakeups,
        "full_gcs": gc_timer.num_full,
        "engine_step_us": step_s * per_token,
        "engine_handoff_us": (engine_s - step_s) * per_token,
        "event_loop_us": loop_s * per_token,
        "event_loop_submit_us": submit_s * per_token,
        "worker_overhead_us": (engine_s - step_s + loop_s) * per_token,
        "router_side_us": router_s * per_token,
        "gc_us": gc_timer.cpu_s * per_token,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--freeze-gc", action="store_true", help="DecodeWorkerConfig.freeze_gc, as a Ray actor has it")
    parser.add_argument("--profile", action="store_true", help="cProfile the last repeat's event loop thread")
    parser.add_argument("--out", type=Path, help="Write the runs and their medians to this JSON file.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # NOTE: the step's CPU stays on the engine thread, where it is timed
    runs = [
        asyncio.run(run(args.streams, args.max_tokens, args.prompt_len, args.seed + i, args.freeze_gc,
                        args.profile and i == args.repeats - 1))
        for i in range(args.repeats)
    ]
    keys = ["wall_s", "engine_step_us", "engine_handoff_us", "event_loop_us", "event_loop_submit_us",
            "worker_overhead_us", "router_side_us",
            "gc_us"]
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    result = {"runs": runs, "medians": medians}
    print(json.dumps(medians | {k: runs[-1][k] for k in ("steps", "polls", "wakeups", "full_gcs")}))
    if args.out is not None:
        machine = {
            "benchmark": "worker_cpu", "device": "cpu", "num_cpus": os.cpu_count(),
            "python_version": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.worker_cpu", *(argv if argv is not None else sys.argv[1:])]),
        }
        args.out.write_text(json.dumps(machine | result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
