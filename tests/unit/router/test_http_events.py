"""A streamed chunk's SSE event: the rendered-once template of a mid-stream text delta (router/http_app.py,
_Render.event) gives byte for byte the event of the chunk model, for any text and choice index."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from router.core import ChoiceDelta
from router.http_app import _ChatRender, _CompletionRender, _sse
from router.tool_calls import ToolCalling

TEXTS = ["hello", " world", 'quote " and \\ backslash', "line\nbreak\ttab\r", "\x00\x01\x1f control",
         "é ü 中文 🙂", "\u2028\u2029 separators", "</script>", "\ue000private", "{\"json\": [1]}", "'"]


def _delta(index: int, text: str, finish_reason: str | None = None) -> ChoiceDelta:
    return ChoiceDelta(index=index, text=text, token_ids=[7], logprobs=None, top_logprobs=None,
                       finish_reason=finish_reason, stop_reason=None, num_prompt_tokens=3, num_completion_tokens=1,
                       num_cached_tokens=0)


def _core() -> Any:
    return SimpleNamespace(config=SimpleNamespace(model_name="m"), token_text=lambda token: f"<{token}>")


@pytest.mark.parametrize("make", [
    lambda: _CompletionRender(_core(), "cmpl-1", 2, None),
    lambda: _ChatRender(_core(), "chatcmpl-1", 2, None),
], ids=["completions", "chat"])
def test_a_text_delta_event_is_the_chunk_models(make):
    render = make()
    for index in (0, 1):
        for text in TEXTS:
            delta = _delta(index, text)
            assert render.event(delta) == _sse(render.chunk(delta)), text
    assert set(render._templates) == {0, 1} and all(t is not None for t in render._templates.values())
    # the last delta (a finish reason) and an empty one go through the model as before
    last = _delta(0, "end", finish_reason="length")
    assert render.event(last) == _sse(render.chunk(last))
    assert render.event(_delta(1, "")) is None


def test_logprobs_and_tool_calls_keep_the_model_path():
    with_logprobs = _CompletionRender(_core(), "cmpl-1", 1, 2)
    delta = _delta(0, "x")
    assert with_logprobs.event(delta) is not None and not with_logprobs._templates
    calling = ToolCalling(tools=[], mode="auto")
    chat = _ChatRender(_core(), "chatcmpl-1", 1, None, calling=calling)
    events = [chat.event(_delta(0, t)) for t in ("Hi ", "<tool_call>", '{"name": "f"')]
    assert events[0] is not None and '"content":"Hi"' in events[0]  # its space held with what may follow
    assert events[1:] == [None, None]  # held back by the tool-call stream, which no sentinel went through
    assert chat._templates == {0: None}
