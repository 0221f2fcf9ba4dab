"""1,000 malformed or hostile HTTP requests (hypothesis: wrong types, unknown fields, bad values,
NaN, bad UTF-8, non-object JSON, oversized bodies, wrong methods) against the router in front of
real workers: every one gets an answer below 500 (a 4xx with OpenAI's error body unless it
happens to be valid), the workers hold no block afterwards, and the next good request is served."""

from __future__ import annotations

import http.client
import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.router.test_http_app import API_KEY, MAX_BODY_BYTES, _serve

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_p", "echo", "ignore_eos", "stop_token_ids", "user",
          "logit_bias", "response_format", "tools", "unknown_field"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.just("default"),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]),
                                           "content": VALUES}), max_size=3)
OBJECT_BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8).flatmap(
    lambda d: st.just(d) if "messages" not in d else MESSAGES.map(lambda m: {**d, "messages": m}))


@st.composite
def hostile(draw: Any) -> tuple[str, str, bytes]:
    kind = draw(st.sampled_from(["object"] * 6 + ["raw", "non_object", "huge", "method"]))
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    if kind == "object":
        return "POST", path, json.dumps(draw(OBJECT_BODIES), allow_nan=True).encode()
    if kind == "raw":  # truncated JSON, bad UTF-8, random bytes
        return "POST", path, draw(st.binary(max_size=200)) + draw(
            st.sampled_from([b"", b"\xff\xfe", b'{"prompt": "\xc3']))
    if kind == "non_object":
        return "POST", path, json.dumps(draw(VALUES)).encode()
    if kind == "huge":
        return "POST", path, b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    return draw(st.sampled_from(["GET", "PUT", "DELETE"])), path, b"{}"


@pytest.fixture(scope="module")
def server(request):
    from engine.models import DEFAULT_MODEL_DIR
    from engine.tokenizer import Tokenizer

    # Short outputs: a body that happens to be valid generates at most 4 tokens.
    srv = _serve(Tokenizer.from_dir(DEFAULT_MODEL_DIR), colocated=False, max_tokens_limit=4, max_n=2)
    yield srv
    held = srv.wait_drained()
    srv.close()
    assert held == [0, 0]


def _send(server: Any, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One request on a connection of its own: its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                       "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_1000_hostile_requests_get_4xx_and_the_server_keeps_serving(server):
    statuses: Counter[int] = Counter()

    @settings(max_examples=1000, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(hostile())
    def one(case: tuple[str, str, bytes]) -> None:
        method, path, body = case
        status, payload = _send(server, method, path, body)
        statuses[status] += 1
        assert status < 500, (status, body[:200], payload[:300])
        if status >= 400:
            error = json.loads(payload)["error"]
            assert error["message"] and error["type"], payload

    one()
    print("statuses", dict(statuses))
    assert sum(statuses.values()) >= 1000
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= 900, statuses
    assert server.wait_drained() == [0, 0]
    good = server.client().completions.create(model="default", prompt="def main():", max_tokens=3, temperature=0)
    assert good.usage.completion_tokens == 3


HOSTILE_VALUES: list[Any] = [
    "\ud800", "a\udfffb", ["ok", "\ud800"], {"a": "\udc00"}, 2**70, -(2**70), 2**63, [2**64], 1e308, float("nan"),
    float("inf"), "", [], {}, None, True, -1, 0, 10**6, "x" * 1000, [1, "a"], [[1, 2]], {"role": "user"},
]
COMPLETION = {"model": "default", "prompt": "def main():", "max_tokens": 3, "temperature": 0.0}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed", "logprobs",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "stop_token_ids",
                   "ignore_eos", "stream_options", "min_tokens", "user"]


def _mutated(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A valid request with one or two fields (or a chat message's role or content) made hostile."""
    body = json.loads(json.dumps(CHAT if chat else COMPLETION))
    fields = ["messages", "messages.role", "messages.content"] if chat else ["prompt"]
    fields += SAMPLING_FIELDS
    for field in rng.sample(fields, rng.randint(1, 2)):
        value = rng.choice(HOSTILE_VALUES)
        if field.startswith("messages."):
            body["messages"][0][field.split(".")[1]] = value
        else:
            body[field] = value
    return body


def test_600_mutated_valid_requests_never_answer_5xx(server):
    """Seeded: valid requests of both endpoints with one or two fields made hostile (lone surrogates,
    integers past 64 bits, wrong types...). None answers 5xx, 503 included: a request the router
    cannot even encode must not mark a worker failed."""
    rng = random.Random(31)
    statuses: Counter[int] = Counter()
    for i in range(600):
        chat = i % 2 == 1
        body = json.dumps(_mutated(rng, chat), allow_nan=True).encode()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, payload = _send(server, "POST", path, body)
        statuses[status] += 1
        assert status < 500, (status, body[:300], payload[:300])
    print("statuses", dict(statuses))
    assert statuses[400] >= 300, statuses  # most mutations are refused, each naming what is wrong
    assert server.wait_drained() == [0, 0]
