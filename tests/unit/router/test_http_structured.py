"""Structured outputs and tool calls over HTTP, without Ray or workers: the real `openai` client ->
uvicorn (a thread) -> build_http_app -> RouterCore -> a scripted dispatcher that answers with a
given text's tokens, one a step (so `<tool_call>` arrives split over deltas). Grammars reach the
dispatcher in SamplingParams; one that does not compile is a 400 with the compiler's message and
never reaches it; the chat template sees the tools; tool calls come back whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from engine.config import MAX_GRAMMAR_CHARS, SamplingParams
from engine.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer
from router.core import RouterConfig, RouterCore
from tests.unit.router.scripted import ScriptedDispatcher, default_grammar_compiler, tools_tokenizer
from tests.unit.router.test_http_app import Server

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather now", "parameters": SCHEMA, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS, "strict": True}}
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tools_tokenizer()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return default_grammar_compiler()


class Served:
    def __init__(self, tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
        self.dispatcher = ScriptedDispatcher(tokenizer)
        self.num_compilers_built = 0

        def build() -> GrammarCompiler:
            self.num_compilers_built += 1
            return compiler

        self.core = RouterCore(self.dispatcher, tokenizer, RouterConfig(), 2048,  # type: ignore[arg-type]
                               grammar_compiler=build)
        self.server = Server(self.core, [])
        self.client = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        self.tokenizer = tokenizer

    def last_prompt(self) -> str:
        return self.tokenizer.decode(self.dispatcher.requests[-1][0], skip_special_tokens=False)

    def last_params(self) -> SamplingParams:
        return self.dispatcher.requests[-1][1]


@pytest.fixture
def served(tokenizer: Tokenizer, compiler: GrammarCompiler) -> Iterator[Served]:
    served = Served(tokenizer, compiler)
    yield served
    served.server.close()
    assert served.core.num_in_flight == 0


# ---- grammars reach the dispatcher; requests without one build no compiler


def test_a_request_without_a_grammar_builds_no_compiler(served):
    out = served.client.chat.completions.create(model="default", messages=ASK)
    assert out.choices[0].message.content == "hello" and out.choices[0].message.tool_calls is None
    out = served.client.completions.create(model="default", prompt="hi", extra_body={"guided_regex": None})
    assert out.choices[0].text == "hello"
    assert served.num_compilers_built == 0 and served.last_params().grammar is None


def test_grammars_reach_the_dispatcher_and_one_compiler_serves_them_all(served):
    served.dispatcher.text = '{"city": "Paris"}'
    out = served.client.chat.completions.create(model="default", messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})
    assert json.loads(out.choices[0].message.content) == {"city": "Paris"}
    assert served.last_params().grammar.kind == "json_schema"
    assert json.loads(served.last_params().grammar.text) == SCHEMA
    served.client.completions.create(model="default", prompt="hi", extra_body={"guided_choice": ["yes", "no"]})
    assert served.last_params().grammar.kind == "ebnf"
    served.client.completions.create(model="default", prompt="hi",
                                     extra_body={"response_format": {"type": "json_object"}})
    assert served.last_params().grammar.kind == "json_object"
    assert served.num_compilers_built == 1


@pytest.mark.parametrize(
    ("route", "fields", "param", "words"),
    [
        ("completions", {"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex",
         "the regex does not compile: Regex parsing error at position 5: The parenthesis is not closed."),
        ("completions", {"guided_grammar": 'root ::= foo'}, "guided_grammar", 'Rule "foo" is not defined'),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", 'Unsupported type "nope"'),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
         "tools", 'Unsupported type "nope"'),
        ("chat", {"guided_json": {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}}, "guided_json",
         f"at most {MAX_GRAMMAR_CHARS} are allowed"),
        ("chat", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "guided_regex and guided_choice: both"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field_and_never_dispatched(served, route, fields, param, words):
    body = {"prompt": "hi"} if route == "completions" else {"messages": ASK}
    status, error = served.server.raw("POST", f"/v1/{route.replace('chat', 'chat/completions')}",
                                      json.dumps({**body, **fields}).encode())
    assert status == 400, error
    assert error["error"]["param"] == param
    assert error["error"]["message"].startswith(param) and words in error["error"]["message"], error
    assert "/project/cpp" not in error["error"]["message"]  # xgrammar's log prefix is dropped
    assert served.dispatcher.requests == []


# ---- tool calls


def test_the_chat_template_sees_the_tools_and_earlier_calls(served):
    served.client.chat.completions.create(model="default", messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], tools=[WEATHER, TIME])
    prompt = served.last_prompt()
    tools = prompt.split("<tools>\n", 1)[1].split("</tools>", 1)[0].splitlines()
    assert [json.loads(t) for t in tools] == [WEATHER, TIME]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt
    served.client.chat.completions.create(model="default", messages=ASK)
    assert "<tools>" not in served.last_prompt()


def test_tool_calls_whole(served):
    served.dispatcher.text = CALLS
    out = served.client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n\n"  # the text outside the blocks
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert served.last_params().grammar.kind == "structural_tag"


def test_a_named_tool_choice_ends_as_stop_and_none_parses_nothing(served):
    served.dispatcher.text = CALLS
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = served.client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert out.choices[0].finish_reason == "stop" and len(out.choices[0].message.tool_calls) == 2
    out = served.client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == CALLS
    assert served.last_params().grammar is None and "<tools>" in served.last_prompt()


def test_streamed_tool_calls_accumulate_in_the_openai_client(served):
    served.dispatcher.text = CALLS
    with served.client.chat.completions.stream(model="default", messages=ASK, tools=[WEATHER, TIME]) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n\n"  # the text outside the blocks
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.parsed_arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    # no chunk shows any of a call's text; each call comes whole, in one delta
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("<" in (d.content or "") for d in deltas)
    sent = [d.tool_calls for d in deltas if d.tool_calls]
    assert [[(t.index, t.function.name) for t in ts] for ts in sent] == [[(0, "get_weather")], [(1, "get_time")]]


def test_streamed_text_without_calls_is_content(served):
    served.dispatcher.text = "No tools <tool needed>."
    with served.client.chat.completions.stream(model="default", messages=ASK, tools=[WEATHER]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "No tools <tool needed>."
    assert not final.choices[0].message.tool_calls and final.choices[0].finish_reason == "stop"


def test_a_reply_of_calls_alone_has_null_content_streamed_and_whole(served):
    served.dispatcher.text = CALLS.split("\n", 1)[1]
    out = served.client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME], n=2)
    assert [c.message.content for c in out.choices] == [None, None]
    assert [len(c.message.tool_calls) for c in out.choices] == [2, 2]
    with served.client.chat.completions.stream(model="default", messages=ASK, tools=[WEATHER, TIME]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content is None and len(final.choices[0].message.tool_calls) == 2


# ---- through real workers: the grammar crosses to the engine, and its output parses


def test_a_forced_tool_call_through_the_workers_streamed_and_whole():
    from engine.models import DEFAULT_MODEL_DIR
    from tests.unit.router.test_http_app import _serve

    server = _serve(Tokenizer.from_dir(DEFAULT_MODEL_DIR), colocated=False)
    try:
        city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                "additionalProperties": False}
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
        forced = {"type": "function", "function": {"name": "get_weather"}}
        ask = dict(model="default", messages=ASK, tools=[tool], tool_choice=forced, max_tokens=200, temperature=0.0)
        whole = server.client().chat.completions.create(**ask)
        choice = whole.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and list(json.loads(call.function.arguments)) == ["city"]
        with server.client().chat.completions.stream(**ask) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "stop" and streamed.message.content is None
        assert [c.function.arguments for c in streamed.message.tool_calls] == [call.function.arguments]
    finally:
        held = server.wait_drained()
        server.close()
    assert held == [0, 0]
