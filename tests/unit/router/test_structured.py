"""Structured outputs, request side: every form a client may send (OpenAI's response_format and
tools, vLLM's structured_outputs and guided_*) becomes the right GrammarSpec in SamplingParams, and
each bad one is a 400 naming the field as the client spelled it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.config import MAX_GRAMMAR_CHARS, GrammarSpec
from router.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from router.tool_calls import MAX_ARGUMENT_WHITESPACE

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**fields: Any) -> GrammarSpec | None:
    return ChatCompletionRequest.parse({**CHAT, **fields}).to_sampling_params(100).grammar


def _completion(**fields: Any) -> GrammarSpec | None:
    return CompletionRequest.parse({"prompt": "hi", **fields}).to_sampling_params().grammar


def _error(make: Any) -> APIError:
    with pytest.raises(APIError) as err:
        make()
    assert err.value.status_code == 400
    return err.value


def _choice_ebnf(*choices: str) -> GrammarSpec:
    return GrammarSpec(kind="ebnf", text="root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


@pytest.mark.parametrize("parse", [_chat, _completion], ids=["chat", "completion"])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec(kind="json_object")),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
            GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
         GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec(kind="regex", text="[a-z]+")),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarSpec(kind="ebnf", text='root ::= "a"')),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, _choice_ebnf("yes", "no")),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec(kind="json_object")),
        ({"structured_outputs": {"json_object": False}}, None),
        ({"structured_outputs": {"structural_tag": '{"type": "x"}'}},
         GrammarSpec(kind="structural_tag", text='{"type": "x"}')),
        ({"guided_json": SCHEMA}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
        ({"guided_regex": "\\d+"}, GrammarSpec(kind="regex", text="\\d+")),
        ({"guided_grammar": 'root ::= "b"'}, GrammarSpec(kind="ebnf", text='root ::= "b"')),
        ({"guided_choice": ["a|b", 'q"t', "😀"]}, _choice_ebnf("a|b", 'q"t', "😀")),
    ],
)
def test_each_form_becomes_its_grammar(parse, fields, expected):
    assert parse(**fields) == expected


def test_choice_grammar_matches_exactly_its_strings():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    choices = ["a b", "x|y", 'q"t', "back\\slash", "new\nline", "é😀", "(p)[q].*+?^$", "\x01"]
    grammar = xgr.Grammar.from_ebnf(_completion(guided_choice=choices).text)
    assert all(accepts(grammar, c) for c in choices)
    assert not any(accepts(grammar, s) for s in ["a", "x", "back\\\\slash", "a bx|y"])


def test_tools_become_the_qwen3_structural_tag():
    spec = _chat(tools=[WEATHER, TIME])
    assert spec is not None and spec.kind == "structural_tag"
    tag = json.loads(spec.text)["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"] and not tag["at_least_one"]
    begins = [t["begin"] for t in tag["tags"]]
    assert begins == [f'<tool_call>\n{{"name": "{name}", "arguments": ' for name in ("get_weather", "get_time")]
    assert tag["tags"][0]["content"]["json_schema"] == SCHEMA
    assert tag["tags"][0]["content"]["max_whitespace_cnt"] == MAX_ARGUMENT_WHITESPACE and not tag["stop_after_first"]
    single = json.loads(_chat(tools=[WEATHER], parallel_tool_calls=False).text)["format"]
    assert single["stop_after_first"]
    assert json.loads(_chat(tools=[WEATHER], tool_choice="required").text)["format"]["at_least_one"]
    forced = {"type": "function", "function": {"name": "get_time"}}
    named = json.loads(_chat(tools=[WEATHER, TIME], tool_choice=forced).text)
    assert named["format"]["type"] == "tag" and '"get_time"' in named["format"]["begin"]
    assert _chat(tools=[WEATHER], tool_choice="none") is None
    assert _chat(tools=[], tool_choice="none") is None


def test_tool_calling_of_a_request():
    calling = ChatCompletionRequest.parse({**CHAT, "tools": [WEATHER]}).tool_calling
    assert calling is not None and (calling.mode, calling.is_active, calling.is_parallel) == ("auto", True, True)
    assert calling.tools == [WEATHER] and calling.finish_reason_of_calls == "tool_calls"
    named = ChatCompletionRequest.parse(
        {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
         "parallel_tool_calls": False}
    ).tool_calling
    assert named is not None and (named.mode, named.name, named.is_parallel) == ("function", "get_weather", False)
    assert named.finish_reason_of_calls == "stop"
    assert ChatCompletionRequest.parse(CHAT).tool_calling is None
    assert ChatCompletionRequest.parse({**CHAT, "tool_choice": "auto"}).tool_calling is None  # nothing to call


def test_tool_messages_reach_the_template_in_transformers_shape():
    request = ChatCompletionRequest.parse({"messages": [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    assert request.template_messages() == [
        {"role": "user", "content": "weather?", "name": "ann"},  # a participant's name, for templates that read it
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


TOO_LONG = "a" * (MAX_GRAMMAR_CHARS + 1)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}},
         "response_format.json_schema.schema", "must be a JSON object, not an array"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": "{}"}}},
         "response_format.json_schema.schema", "not a string"),  # OpenAI's schema is an object, never text
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
         "response_format.json_schema.schema", "Field required"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required when type"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "not a number"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "is not valid JSON"),
        ({"guided_json": "[1, 2]"}, "guided_json", "must be a JSON object, not an array"),
        ({"guided_regex": ""}, "guided_regex", "is empty"),
        ({"guided_choice": []}, "guided_choice", "is empty"),
        ({"guided_choice": ["a", 1]}, "guided_choice[1]", "valid string"),
        ({"structured_outputs": {"regex": TOO_LONG}}, "structured_outputs.regex",
         f"is {MAX_GRAMMAR_CHARS + 1} characters long; at most {MAX_GRAMMAR_CHARS}"),
        ({"guided_grammar": TOO_LONG}, "guided_grammar", f"at most {MAX_GRAMMAR_CHARS} are allowed"),
        ({"guided_json": {"description": TOO_LONG}}, "guided_json", f"at most {MAX_GRAMMAR_CHARS} are allowed"),
    ],
)
def test_bad_constraint_names_its_field(fields, param, words):
    for parse in (_chat, _completion):
        err = _error(lambda: parse(**fields))
        assert err.param == param and err.message.startswith(f"{param}: ") and words in err.message, err.message


@pytest.mark.parametrize(
    ("fields", "first", "second"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs.regex", "structured_outputs.choice"),
        ({"guided_json": SCHEMA, "structured_outputs": {"grammar": 'root ::= "a"'}},
         "structured_outputs.grammar", "guided_json"),
        ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_grammar", "guided_choice"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format", "tools"),
    ],
)
def test_two_constraints_are_refused_naming_both(fields, first, second):
    err = _error(lambda: _chat(**fields))
    assert err.param == first
    assert err.message.startswith(f"{first} and {second}: both constrain the output; a request may set at most one")


def test_tools_with_tool_choice_none_leave_room_for_response_format():
    fields = {"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "none"}
    assert _chat(**fields) == GrammarSpec(kind="json_object")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name", "pattern"),
        ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1].function.name", "Field required"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "at most 64"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "valid dictionary"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' is given twice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "function 'get_time' is not among tools (get_weather)"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be 'none'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "must be the JSON text of the arguments object"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "must be the JSON text of an object"),
    ],
)
def test_bad_tools_name_the_field(fields, param, words):
    err = _error(lambda: _chat(**fields))
    assert err.param == param and err.message.startswith(f"{param}: ") and words in err.message, err.message
