"""The router's CPU per streamed token, without a GPU or Ray: a fake colocated worker that answers
one token per running request per step (every --step-ms), the real Dispatcher, RouterCore and
FastAPI app, driven through ASGI directly (no sockets) by --streams concurrent streaming
completions of --max-tokens each. Reports process CPU seconds per token (the fake worker's share
is small: one NamedTuple or model per request per step) and the SSE events sent, and the wall time and
CPU per request until the worker had every request (the router's admission of a burst; the first
steps' tokens stream meanwhile). The garbage collector is set as a router replica sets it once built. With --step-ms
high enough that the router keeps up, every step's token is its own event (no coalescing).

    python -m bench.router_cpu --streams 256 --max-tokens 100 --step-ms 20 [--prompt-len 8] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import random
import time
from typing import Any

from engine import Tokenizer
from engine.config import DEFAULT_MODEL
from engine.models import DEFAULT_MODEL_DIR
from engine.process_gc import settle_after_startup
from protocol.api import WorkerStatsMsg
from protocol.messages import GenerateRequestMsg, TokenBatchMsg, TokenOutputMsg
from router import Dispatcher, Workers
from router.core import RouterConfig, RouterCore
from router.http_app import build_http_app


class FakeWorker:
    """One token per running request every `step_s`; polls and submits as a DecodeWorker answers them."""

    def __init__(self, vocab: int, step_s: float) -> None:
        self.vocab, self.step_s = vocab, step_s
        self.running: dict[str, list[int]] = {}  # request id -> [max_tokens, tokens so far]
        self.outbox: list[TokenOutputMsg] = []
        self.ready = asyncio.Event()
        self.num_steps = 0
        self.task: asyncio.Task[None] | None = None
        self.num_submitted = 0
        self.all_submitted_at: tuple[float, float] | None = None  # (perf_counter, process_time) at the last submit

    async def submit(self, raw: bytes) -> None:
        msg = GenerateRequestMsg.decode(raw)
        self.running[msg.request_id] = [msg.params.max_tokens, 0]
        self.num_submitted += 1
        self.all_submitted_at = (time.perf_counter(), time.process_time())
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._steps())

    async def _steps(self) -> None:
        rng = random.Random(0)
        while True:
            await asyncio.sleep(self.step_s)
            outputs = []
            for rid, state in list(self.running.items()):
                state[1] += 1
                finish = "length" if state[1] >= state[0] else None
                outputs.append(TokenOutputMsg(request_id=rid, new_token_ids=[rng.randrange(100, self.vocab)],
                                              finish_reason=finish, num_prompt_tokens=8))
                if finish:
                    del self.running[rid]
            if outputs:
                self.num_steps += 1
                self.outbox.extend(outputs)
                self.ready.set()

    async def poll(self, router_id: str, timeout_s: float = 1.0) -> bytes:
        if not self.outbox:
            try:
                await asyncio.wait_for(self.ready.wait(), timeout_s)
            except TimeoutError:
                pass
        outputs, self.outbox = self.outbox, []
        self.ready.clear()
        return TokenBatchMsg(worker_id="w0", outputs=outputs).encode()

    async def abort(self, request_id: str) -> bool:
        self.running.pop(request_id, None)
        return True

    async def stats(self) -> WorkerStatsMsg:
        return WorkerStatsMsg(worker_id="w0", role="decode", pid=os.getpid(), is_healthy=True,
                              num_running=len(self.running), num_waiting=0, num_blocks=1000, num_free_blocks=1000)


async def one_stream(app: Any, i: int, max_tokens: int, counts: list[int], prompt_len: int) -> None:
    prompt = [(i * 7919 + k * 31) % 1000 + 4 for k in range(prompt_len)]  # distinct prompts: none shares a block
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0.6}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1000 + i), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent, done = False, asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"status {message['status']}")
        if message["type"] == "http.response.body":
            counts[0] += message.get("body", b"").count(b"data: ")
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)


async def run(streams: int, max_tokens: int, step_s: float, prompt_len: int) -> dict[str, Any]:
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    worker = FakeWorker(tokenizer.vocab_size, step_s)
    dispatcher = Dispatcher("r0", Workers.of(prefill={}, decode={"w0": worker}))
    core = RouterCore(dispatcher, tokenizer, RouterConfig(model_name=DEFAULT_MODEL, max_in_flight=4096), 4096)
    app = build_http_app(core)
    threshold = gc.get_threshold()
    settle_after_startup()  # NOTE: as a router replica does once built (router/ingress.py)
    counts = [0]
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    try:
        await asyncio.gather(*(one_stream(app, i, max_tokens, counts, prompt_len) for i in range(streams)))
    finally:
        wall, cpu = time.perf_counter() - started_wall, time.process_time() - started_cpu
        await dispatcher.close()
        if worker.task is not None:
            worker.task.cancel()
        gc.unfreeze()  # NOTE: the next repeat builds and settles its own
        gc.set_threshold(*threshold)
    tokens = streams * max_tokens
    assert worker.num_submitted == streams and worker.all_submitted_at is not None
    admit_wall, admit_cpu = worker.all_submitted_at[0] - started_wall, worker.all_submitted_at[1] - started_cpu
    return {"streams": streams, "max_tokens": max_tokens, "prompt_len": prompt_len, "step_ms": step_s * 1e3,
            "wall_s": wall, "cpu_s": cpu,
            "tokens": tokens, "sse_events": counts[0], "worker_steps": worker.num_steps,
            "cpu_us_per_token": cpu / tokens * 1e6, "tokens_per_s": tokens / wall,
            # until the worker had every request: the router's admission (and the first tokens' streaming)
            "admit_wall_s": admit_wall, "admit_cpu_us_per_request": admit_cpu / streams * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--prompt-len", type=int, default=8, help="token ids a prompt (issue 29's workload: 100-1,024)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the last repeat, top 30 by own time")
    args = parser.parse_args()
    rows = []
    for i in range(args.repeats):
        profiler = cProfile.Profile() if args.profile and i == args.repeats - 1 else None
        if profiler:
            profiler.enable()
        rows.append(asyncio.run(run(args.streams, args.max_tokens, args.step_ms / 1e3, args.prompt_len)))
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
