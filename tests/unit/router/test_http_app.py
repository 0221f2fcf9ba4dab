"""The OpenAI HTTP layer end to end, without Ray: the real `openai` client -> uvicorn (a thread,
127.0.0.1, a free port) -> build_http_app -> RouterCore -> Dispatcher -> in-process workers over the
local transport. Greedy text equals the offline LLM's; streaming equals non-streaming; bad input
gets a 4xx OpenAI error body; a client that leaves early leaves no KV block held."""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import http.client
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import openai
import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams, Tokenizer
from engine.llm import engine_config
from engine.models import DEFAULT_MODEL_DIR
from kvtransfer import LocalHub
from kvtransfer.netaddr import free_port
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, DispatcherConfig, LocalPrefillConfig, NoCapacityError, RequestFailedError, Workers
from router.core import ListenAddress, RouterConfig, RouterCore
from router.http_app import build_http_app
from router.http_server import start_http_server

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
API_KEY = "test-key"
MAX_BODY_BYTES = 64 << 10
PROMPT = "Hello world, the story of a"
# A request of LONG tokens runs for seconds here (about 1.6 s per 1000 tokens on 2 cores), so its
# blocks are free within ABORT_WAIT_S only when it was aborted.
LONG = 2000
ABORT_WAIT_S = 1.0
T = TypeVar("T")


class Server:
    """The router replica's HTTP server (router/http_server.py) on its own event loop in a thread; the
    workers and the Dispatcher live on that loop."""

    def __init__(self, core: RouterCore, workers: list[Any]) -> None:
        self.core, self.workers = core, workers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = free_port()
        self.server = self.call(start_http_server(build_http_app(core), ListenAddress(port=self.port)))
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 10) -> T:
        """coro's result on the server's loop; past timeout_s every thread's stack goes to stderr first
        (a CI run once timed out closing the dispatcher here, and the stacks say what the loop was doing)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            faulthandler.dump_traceback(all_threads=True)
            raise

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def held_blocks(self) -> list[int]:
        return [self.call(w.check_integrity()) for w in self.workers]

    def wait_drained(self, timeout_s: float = 5.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while any(held := self.held_blocks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return held

    def raw(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One request with http.client; a body that is an iterator goes chunked, without Content-Length."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            headers = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
            conn.request(method, path, body=body, headers=headers, encode_chunked=not isinstance(body, bytes | None))
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            conn.close()

    def close(self) -> None:
        self.call(self.core.dispatcher.close())
        for w in self.workers:
            self.call(w.shutdown())
        self.call(self.server.stop(2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server's loop did not stop"
        self.loop.close()


def _workers(colocated: bool) -> tuple[Workers, list[Any]]:
    local = {"hub": LocalHub()}
    decode = DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine_config(**ENGINE), transport="local"), transport_options=local
    )
    if colocated:
        return Workers.of(prefill={}, decode={"d0": decode}), [decode]
    prefill = PrefillWorker(
        PrefillWorkerConfig(worker_id="p0", engine=engine_config(**ENGINE), transport="local"), transport_options=local
    )
    return Workers.of(prefill={"p0": prefill}, decode={"d0": decode}), [prefill, decode]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def offline() -> Callable[[list[int], int], str]:
    """Greedy text of the offline engine."""
    llm = LLM("default", device="cpu")

    def run(prompt_ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt_ids], params)[0].outputs[0].text

    return run


def _serve(tokenizer: Tokenizer, colocated: bool, **config: Any) -> Server:
    workers, objs = _workers(colocated)
    config = {"api_key": API_KEY, "max_body_bytes": MAX_BODY_BYTES, **config}
    max_model_len = objs[-1].loop.engine.max_model_len
    # NOTE: every prompt through the prefill worker (these prompts are short): the KV push is under test too.
    remote = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))
    dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=remote)
    core = RouterCore(dispatcher, tokenizer, RouterConfig(**config), max_model_len)
    return Server(core, objs)


@pytest.fixture(scope="module")
def disagg(tokenizer: Tokenizer) -> Iterator[Server]:
    server = _serve(tokenizer, colocated=False)
    yield server
    held = server.wait_drained()
    server.close()
    assert held == [0, 0]


@pytest.fixture(scope="module")
def coloc(tokenizer: Tokenizer) -> Iterator[Server]:
    server = _serve(tokenizer, colocated=True, max_in_flight=1)  # max_in_flight=1: the 429 test
    yield server
    held = server.wait_drained()
    server.close()
    assert held == [0]


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


# ---- completions and chat


@pytest.mark.parametrize("mode", ["disagg", "coloc"])
def test_completion_text_and_token_ids_equal_offline(mode, request, tokenizer, offline):
    server: Server = request.getfixturevalue(mode)
    client = server.client()
    ids = tokenizer.encode(PROMPT)
    expected = offline(ids, 12)
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, **GREEDY)
    assert out.choices[0].text == expected and expected
    assert out.choices[0].finish_reason == "length"
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    by_ids = client.completions.create(model="default", prompt=ids, max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == expected
    assert server.wait_drained() == [0] * len(server.workers)


def test_chat_completion_equals_offline(disagg, tokenizer, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    out = disagg.client().chat.completions.create(model="default", messages=messages, max_tokens=10, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline(ids, 10)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 10)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    joined = [{"role": "user", "content": "Tell me\na story"}]
    a = disagg.client().chat.completions.create(model="default", messages=parts, max_tokens=6, **GREEDY)
    b = disagg.client().chat.completions.create(model="default", messages=joined, max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streaming_equals_non_streaming(disagg):
    client = disagg.client()
    whole = client.completions.create(model="default", prompt=PROMPT, max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(
        model="default", prompt=PROMPT, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=12, **GREEDY)
    stream = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 12
    no_usage = list(client.chat.completions.create(model="default", messages=messages, max_tokens=3, stream=True))
    assert all(c.usage is None for c in no_usage) and all(c.choices for c in no_usage)


def test_n_with_seed_fans_out_with_seed_plus_index(disagg):
    client = disagg.client()
    sampled = dict(model="default", prompt=PROMPT, max_tokens=10, temperature=1.5, extra_body={"ignore_eos": True})
    both = client.completions.create(n=2, seed=7, **sampled)
    assert sorted(c.index for c in both.choices) == [0, 1]
    texts = {c.index: c.text for c in both.choices}
    assert texts[0] == client.completions.create(seed=7, **sampled).choices[0].text
    assert texts[1] == client.completions.create(seed=8, **sampled).choices[0].text
    assert texts[0] != texts[1]
    assert both.usage.completion_tokens == 20
    streamed = list(client.completions.create(n=2, seed=7, stream=True, **sampled))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == index) == texts[index]


def test_several_prompts_give_one_choice_each(disagg, tokenizer, offline):
    prompts = [PROMPT, "Another day"]
    out = disagg.client().completions.create(model="default", prompt=prompts, max_tokens=5, **GREEDY)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [
        offline(tokenizer.encode(p), 5) for p in prompts
    ]
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_stop_string_ends_the_text_and_the_request(disagg):
    client = disagg.client()
    full = client.completions.create(model="default", prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = full[10:13]
    expected = full[: full.index(stop)]
    assert len(expected) < len(full) - 3
    # max_tokens=LONG: only the abort on the stop string frees the blocks within the wait below
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=LONG, stop=[stop], **GREEDY)
    assert out.choices[0].text == expected
    assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", stop)
    assert out.usage.completion_tokens < 24
    assert disagg.wait_drained(timeout_s=ABORT_WAIT_S) == [0, 0]
    streamed = client.completions.create(model="default", prompt=PROMPT, max_tokens=LONG, stop=stop, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert disagg.wait_drained(timeout_s=ABORT_WAIT_S) == [0, 0]


def test_logprobs(disagg):
    client = disagg.client()
    out = client.completions.create(model="default", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0.0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the sampled token is the top one
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4) for c in content)


def test_models_health_and_unknown_routes(disagg):
    models = disagg.client().models.list()
    assert [m.id for m in models.data] == ["default"]
    conn = http.client.HTTPConnection("127.0.0.1", disagg.port, timeout=10)
    conn.request("GET", "/health")  # no API key
    assert conn.getresponse().status == 200
    conn.close()
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        code, body = disagg.raw(method, path)
        assert code == status and path in body["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="nonexistent"):
        disagg.client().completions.create(model="nonexistent", prompt="hi", max_tokens=2)


class _Recorder:
    """A RouterMetrics that records every call as (method name, keyword arguments); positional
    arguments (on_prefill_result's message) under "args"."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kw: self.calls.append((name, {**kw, "args": args} if args else kw))


def test_metrics_hook(disagg):
    recorder = disagg.core.metrics = _Recorder()
    # NOTE: the previous test's last on_response (a 404 of /v1/completions) may land after its test
    # ended: let it, then forget it.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        seen = len(recorder.calls)
        time.sleep(0.2)
        if len(recorder.calls) == seen:
            break
    recorder.calls.clear()

    def mine() -> list[tuple[str, dict[str, Any]]]:
        return [(n, kw) for n, kw in recorder.calls if kw.get("route", "/v1/completions") == "/v1/completions"]

    try:
        disagg.client().completions.create(model="default", prompt=PROMPT, max_tokens=3, **GREEDY)
        deadline = time.monotonic() + 5
        while not any(n == "on_response" for n, _ in mine()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        disagg.core.metrics = None
    gaps = [kw for n, kw in mine() if n == "on_inter_token"]
    assert sum(g["num_tokens"] for g in gaps) == 2 and all(g["gap_s"] >= 0 for g in gaps)  # tokens 2 and 3
    (choice,) = [kw for n, kw in mine() if n == "on_choice_finished"]
    assert (choice["finish_reason"], choice["num_completion_tokens"]) == ("length", 3)
    assert choice["time_to_first_token_s"] is not None and choice["elapsed_s"] >= choice["time_to_first_token_s"]
    (response,) = [kw for n, kw in mine() if n == "on_response"]
    assert response["status_code"] == 200


# ---- refusals


def test_api_key(disagg):
    with pytest.raises(openai.AuthenticationError):
        disagg.client(api_key="wrong").models.list()
    status, body = disagg.raw("GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "Bearer" in body["error"]["message"]


def test_body_limit_with_and_without_content_length(disagg):
    big = json.dumps({"model": "default", "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, body = disagg.raw("POST", "/v1/completions", big, {"Content-Type": "application/json"})
    assert status == 413 and str(MAX_BODY_BYTES) in body["error"]["message"]
    chunks = iter([big[i:i + 8192] for i in range(0, len(big), 8192)])
    status, body = disagg.raw("POST", "/v1/completions", chunks, {"Transfer-Encoding": "chunked"})
    assert status == 413 and str(MAX_BODY_BYTES) in body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"model": "default", "prompt": "hi"', None, "not valid JSON"),
        (b'{"model": "default", "prompt": "\xff\xfe"}', None, "not valid UTF-8"),
        (b'["a list"]', None, "JSON object"),
        (b'{"model": "default", "prompt": "hi", "max_tokens": "ten"}', "max_tokens", "valid integer"),
        (b'{"model": "default", "prompt": {"a": 1}}', "prompt", "list of token ids"),
        (b'{"model": "default", "prompt": "hi", "echo": true}', "echo", "not supported"),
        (b'{"model": "default", "prompt": "hi", "n": 9}', "n", "at most 8"),
        (b'{"model": "default", "prompt": [5, 2048]}', "prompt", "outside the vocabulary [0, 2048)"),
        (b'{"model": "default", "prompt": [5, -1, 7]}', "prompt", "prompt[1]: token id -1 is outside the vocabulary"),
        (b'{"model": "default", "prompt": [5, true]}', "prompt", "list of token ids"),  # a bool is no token id
        (b'{"model": "default", "prompt": [5, 1.5]}', "prompt", "list of token ids"),
        (b'{"model": "default", "prompt": [[5], [6, false]]}', "prompt", "list of token ids"),
        (b'{"model": "default", "messages": 5}', "messages", "valid list"),
        # valid JSON that is not text: a lone UTF-16 surrogate
        (b'{"model": "default", "prompt": "a\\ud800b"}', "prompt", "lone surrogate"),
        (b'{"model": "default", "prompt": ["ok", "\\udfff"]}', "prompt", "lone surrogate"),
        (b'{"model": "default", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages",
         "lone surrogate"),
        (b'{"model": "default", "prompt": "hi", "stop": "\\ud800"}', "stop", "lone surrogate"),
        # integers past 64 bits
        (b'{"model": "default", "prompt": "hi", "top_k": 1180591620717411303424}', "top_k", "out of range"),
        (b'{"model": "default", "prompt": "hi", "seed": -1180591620717411303424}', "seed", "out of range"),
        (b'{"model": "default", "prompt": [1180591620717411303424]}', "prompt", "out of range"),
        (b'{"model": "default", "prompt": "hi", "top_k": 4611686018427387904}', None, None),  # 2**62: valid
    ],
)
def test_bad_request_is_400_with_an_openai_error(disagg, body, param, words):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = disagg.raw("POST", path, body, {"Content-Type": "application/json"})
    if words is None:  # a valid request among them
        assert status == 200, answer
        return
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and words in answer["error"]["message"]


def test_limits_name_the_field_and_the_limit(disagg):
    client = disagg.client()
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: 5000 .* limit of 4096"):
        client.completions.create(model="default", prompt="hi", max_tokens=5000)
    chat = dict(model="default", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match=r"max_completion_tokens: .*greater than or equal to 1 \(got 0\)"):
        client.chat.completions.create(max_completion_tokens=0, **chat)
    with pytest.raises(openai.BadRequestError, match=r"prompt: has 2100 tokens; at most 2047"):
        client.completions.create(model="default", prompt=[5] * 2100, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: 100 tokens do not fit.* at most 48"):
        client.completions.create(model="default", prompt=[5] * 2000, max_tokens=100)
    assert disagg.held_blocks() == [0, 0]


# ---- leaving early, overload, worker errors


def test_client_leaving_a_stream_frees_every_block(disagg):
    stream = disagg.client().completions.create(
        model="default", prompt=PROMPT, max_tokens=LONG, stream=True, **GREEDY
    )
    for _ in range(3):
        next(stream)
    assert all(held > 0 for held in disagg.held_blocks()[1:])  # the decode worker runs it
    stream.close()
    assert disagg.wait_drained(timeout_s=ABORT_WAIT_S) == [0, 0]


def test_client_leaving_a_non_streamed_request_frees_every_block(disagg):
    conn = http.client.HTTPConnection("127.0.0.1", disagg.port, timeout=0.5)
    body = json.dumps({"model": "default", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {API_KEY}"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    assert disagg.held_blocks()[1] > 0
    conn.close()
    assert disagg.wait_drained(timeout_s=ABORT_WAIT_S) == [0, 0]


def test_max_in_flight_answers_429_with_retry_after(coloc):
    client = coloc.client()
    stream = client.completions.create(model="default", prompt=PROMPT, max_tokens=LONG, stream=True, **GREEDY)
    next(stream)
    with pytest.raises(openai.RateLimitError, match="max_in_flight = 1") as err:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    stream.close()
    deadline = time.monotonic() + 5
    while coloc.core.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=2).choices[0].text
    assert coloc.wait_drained() == [0]


class _FailingDispatcher:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def generate(self, request_id, prompt_token_ids, params):
        raise self.error
        yield  # an async generator, like Dispatcher.generate

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "status"),
    [(NoCapacityError("no decode worker has KV blocks"), 503), (RequestFailedError("KV transfer failed: gone"), 500)],
)
def test_dispatcher_errors_map_to_503_and_500(tokenizer, error, status):
    core = RouterCore(_FailingDispatcher(error), tokenizer, RouterConfig(), 2048)  # type: ignore[arg-type]
    server = Server(core, [])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError, match=str(error)) as err:
                client.completions.create(model="default", prompt="hi", max_tokens=2, stream=stream)
            assert err.value.status_code == status
            assert ("retry-after" in err.value.response.headers) == (status == 503)
        assert core.num_in_flight == 0
    finally:
        server.close()


# ---- metrics and traces


def test_prometheus_metrics_and_request_trace(disagg):
    from router.metrics import PrometheusMetrics

    async def worker_stats():
        return [await w.stats() for w in disagg.workers]

    metrics = PrometheusMetrics("default", worker_stats=worker_stats)
    disagg.core.metrics = metrics
    disagg.core.dispatcher.on_prefill_result = disagg.core.on_prefill_result
    try:
        done = disagg.client().completions.create(model="default", prompt=PROMPT, max_tokens=4, **GREEDY)
        import urllib.request

        scrape = urllib.request.Request(f"{disagg.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(scrape, timeout=30) as response:
            status, text = response.status, response.read().decode()
        status_trace, trace = disagg.raw("GET", f"/v1/requests/{done.id}/trace")
    finally:
        disagg.core.metrics = None
        disagg.core.dispatcher.on_prefill_result = None
    assert status == 200
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    assert lines['pdserve:time_to_first_token_seconds_count{model_name="default"}'] == 1
    assert lines['pdserve:generation_tokens_total{model_name="default"}'] == 4
    assert lines['pdserve:inter_token_latency_seconds_count{model_name="default"}'] == 3
    assert lines['pdserve:request_success_total{finished_reason="length",model_name="default"}'] == 1
    assert lines['pdserve:kv_transfer_bytes_total{model_name="default"}'] > 0
    assert any(k.startswith("pdserve:kv_cache_usage_perc{") for k in lines)
    assert status_trace == 200
    (choice,) = trace["choices"]
    names = [e["name"] for e in choice["events"]]
    assert names == ["prefill_result", "first_token", "first_decode_token", "finished"], names
    times = [e["t_s"] for e in choice["events"]]
    assert times == sorted(times)
    assert choice["attributes"]["kv_push_bytes"] > 0 and choice["attributes"]["finish_reason"] == "length"
    assert disagg.raw("GET", "/v1/requests/cmpl-unknown/trace")[0] == 404
