"""`pdserve bench` end to end against a tiny fake OpenAI SSE server (aiohttp, 127.0.0.1, a free port)
whose chunk timings are known: the first token TTFT_S after the request, then one token every ITL_S.
The reported metrics must match those timings, counts must come from its usage, and its failures
(an HTTP error status, an error event mid-stream, a wrong key) must be counted and named."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from loadgen import BenchConfig
from loadgen.cli import bench, main

TTFT_S, ITL_S, KEY = 0.12, 0.03, "fake-key"
SLACK_S = 0.08  # scheduling slack on a busy 2-core machine


class FakeOpenAI:
    """Streams max_tokens one-token chunks; prompt 'fail' gets a 503, 'midfail' an error event after 2 tokens."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.num_open = self.num_requests = 0
        self.bodies: list[dict] = []
        app = web.Application()
        app.router.add_post("/v1/completions", self.stream)
        app.router.add_post("/v1/chat/completions", self.stream)
        self.runner = web.AppRunner(app)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "incorrect API key provided"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        self.num_requests += 1
        is_chat = "messages" in body
        prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
        max_tokens = body["max_completion_tokens"] if is_chat else body["max_tokens"]
        if prompt == "fail":
            return web.json_response({"error": {"message": "server overloaded, retry later"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.num_open += 1
        try:
            async def event(data: dict | str) -> None:
                await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

            if is_chat:  # the opening chunk: a role, no token
                await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(TTFT_S)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(ITL_S)
                if prompt == "midfail" and i == 2:
                    await event({"error": {"message": "worker lost", "code": 500}})
                    await event("[DONE]")
                    return response
                finish = "length" if i == max_tokens - 1 else None
                choice = ({"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": finish} if is_chat
                          else {"index": 0, "text": f"t{i}", "finish_reason": finish})
                await event({"choices": [choice]})
            num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            usage = {"prompt_tokens": num_prompt, "completion_tokens": max_tokens,
                     "total_tokens": num_prompt + max_tokens}
            await event({"choices": [], "usage": usage})
            await event("[DONE]")
            return response
        finally:
            self.num_open -= 1


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    yield server
    server.stop()
    assert server.num_open == 0, "a stream was left open"  # the leak check


def _url(fake: FakeOpenAI) -> str:
    return f"http://127.0.0.1:{fake.port}/v1"


def test_metrics_match_the_fake_timings(fake: FakeOpenAI, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    config = BenchConfig(base_url=_url(fake), api_key=KEY, num_prompts=8, input_len="5:9", output_len=5,
                         max_concurrency=4, slo_ttft_ms=1000, slo_tpot_ms=1000, out=out, is_progress=False)
    result = bench(config)
    assert fake.num_requests == 8 + 1  # and the probe
    body = fake.bodies[-1]
    assert body["ignore_eos"] is True and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert isinstance(body["prompt"], list) and body["max_tokens"] == 5
    (run,) = result.runs
    m = run.metrics
    assert (m.num_sent, m.num_completed, m.num_errored, m.num_good, m.num_off_length) == (8, 8, 0, 8, 0)
    for r in run.records:
        assert r.completion_tokens == 5 and 5 <= r.prompt_tokens <= 9  # the fake's usage
        assert len(r.chunk_times) == 5
        assert TTFT_S <= r.ttft <= TTFT_S + SLACK_S
        assert r.e2e >= TTFT_S + 4 * ITL_S and r.ttft <= r.e2e
    assert ITL_S - 0.01 <= m.itl_ms.median / 1e3 <= ITL_S + SLACK_S / 2
    assert ITL_S - 0.01 <= m.tpot_ms.mean / 1e3 <= ITL_S + SLACK_S / 2
    assert TTFT_S <= m.ttft_ms.median / 1e3 <= TTFT_S + SLACK_S
    assert m.output_token_throughput == pytest.approx(40 / m.duration_s)
    # 8 requests of ~0.24 s, 4 at a time: about two rounds
    assert 2 * (TTFT_S + 4 * ITL_S) <= m.duration_s <= 2 * (TTFT_S + 4 * ITL_S) + 1.0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "loadgen" and doc["config"]["max_concurrency"] == 4
    saved = doc["runs"][0]
    assert saved["metrics"]["num_sent"] == len(saved["records"]) == 8
    assert result.png_path == out.with_suffix(".png") and result.png_path.stat().st_size > 0


def test_failures_are_counted_and_named(fake: FakeOpenAI, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    prompts = ["a b c", "fail", "midfail", "d e", "f"]
    dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4}) + "\n" for p in prompts))
    config = BenchConfig(base_url=_url(fake), api_key=KEY, endpoint="chat", workload="jsonl", dataset=dataset,
                         request_rate=50, seed=3, is_progress=False)
    (run,) = bench(config).runs
    m = run.metrics
    assert (m.num_sent, m.num_completed, m.num_errored) == (5, 3, 2)
    failed = {r.index: r for r in run.records if not r.is_success}
    assert failed[1].http_status == 503 and failed[1].error == "server overloaded, retry later"
    assert failed[2].http_status == 200 and "error event in the stream: worker lost" in failed[2].error
    assert m.errors == {"503: server overloaded, retry later": 1,
                        "200: error event in the stream: worker lost": 1}
    assert m.total_prompt_tokens == 3 + 2 + 1 and m.total_completion_tokens == 12
    for r in run.records:
        if r.is_success:  # chat's opening role chunk is not a token
            assert len(r.chunk_times) == 4 and TTFT_S <= r.ttft <= TTFT_S + SLACK_S


def test_sweep_writes_one_run_per_rate(fake: FakeOpenAI, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    code = main(["--base-url", _url(fake), "--api-key", KEY, "--num-prompts", "3", "--input-len", "4",
                 "--output-len", "2", "--sweep-rates", "20,40", "--slo-ttft-ms", "500", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "loadgen_sweep"
    assert [(r["request_rate"], r["seed"]) for r in doc["runs"]] == [(20.0, 0), (40.0, 1)]
    assert all(r["metrics"]["num_completed"] == 3 and r["metrics"]["goodput"] > 0 for r in doc["runs"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_probe_failure_says_what_to_check(fake: FakeOpenAI, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--base-url", _url(fake), "--api-key", "wrong", "--num-prompts", "2", "--no-progress"])
    assert code == 1 and fake.num_requests == 0
    err = capsys.readouterr().err
    assert "HTTP 401: incorrect API key provided" in err and "--api-key" in err
