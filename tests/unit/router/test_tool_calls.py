"""Tool calls read back out of the Hermes/Qwen3 format: a whole output, and one streamed in pieces
(a `<tool_call>` split across pieces, text before a call, two calls) split the same way."""

from __future__ import annotations

import json

import pytest

from router.tool_calls import ToolCallStream, parse_tool_calls


def _block(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


WEATHER = _block("get_weather", {"city": "Paris"})
TIME = _block("get_time", {"zone": "UTC", "nested": {"a": [1, 2]}})
WEATHER_CALL = ("get_weather", {"city": "Paris"})
TIME_CALL = ("get_time", {"zone": "UTC", "nested": {"a": [1, 2]}})


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("just text", "just text", []),
        (WEATHER, None, [WEATHER_CALL]),
        (f"Let me check.\n{WEATHER}", "Let me check.\n", [WEATHER_CALL]),
        (f"{WEATHER}\n{TIME}", None, [WEATHER_CALL, TIME_CALL]),
        (f"a {WEATHER} b {TIME}\n", "a  b \n", [WEATHER_CALL, TIME_CALL]),
        (f"  \n{WEATHER}\n\n", None, [WEATHER_CALL]),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),  # kept as text
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
        ('<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", {})]),
        ('x <tool_call>\n{"name": "f", "argu', 'x <tool_call>\n{"name": "f", "argu', []),  # cut short: text
        ("ends in <tool_c", "ends in <tool_c", []),
    ],
)
def test_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _stream(pieces: list[str]) -> tuple[list[str], list[tuple[int, object]]]:
    """(the content of each feed, then of finish; (piece index, call) of each call)."""
    stream = ToolCallStream()
    contents, calls = [], []
    for i, piece in enumerate(pieces):
        content, new = stream.feed(piece)
        contents.append(content)
        calls += [(i, c) for c in new]
    contents.append(stream.finish())
    assert stream.num_calls == len(calls)
    return contents, calls


@pytest.mark.parametrize(
    "text",
    [
        "just text, no calls at all",
        f"Let me check.\n{WEATHER}",
        f"{WEATHER}\n{TIME}",
        f"a {WEATHER} b {TIME} trailing <tool_ and <tool_call> unclosed",
        "<tool_call>\nnot json\n</tool_call> then text",
        f"  \n{WEATHER}\n\n",
    ],
)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_streamed_in_pieces_equals_whole(text, size):
    contents, calls = _stream([text[i: i + size] for i in range(0, len(text), size)])
    whole_content, whole_calls = parse_tool_calls(text)
    assert ("".join(contents) or None) == whole_content
    assert _calls([c for _, c in calls]) == _calls(whole_calls)


def test_a_split_start_is_held_back_and_a_call_is_sent_when_it_closes():
    pieces = ["Sure. <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool', "_call>"]
    contents, calls = _stream(pieces)
    assert contents == ["Sure.", "", "", "", " "]  # the space after 'Sure.' waits: it is content only once some is
    assert [(i, c.name, json.loads(c.arguments)) for i, c in calls] == [(3, "get_weather", {"city": "Paris"})]


def test_a_false_start_is_released():
    contents, calls = _stream(["a <tool", "box> b"])
    assert contents == ["a", " <toolbox> b", ""] and calls == []


def test_text_between_two_calls():
    contents, calls = _stream([WEATHER[:5], WEATHER[5:] + " so far; now ", TIME])
    assert contents == ["", " so far; now", "", " "]  # the space before the second call waits for the end
    assert [(i, c.name) for i, c in calls] == [(1, "get_weather"), (2, "get_time")]
