"""The gRPC front end's structured outputs, without a server or Ray: SamplingOptions' constraint
becomes the request's grammar, and a bad one is INVALID_ARGUMENT naming `sampling.<field>`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from engine.config import MAX_GRAMMAR_CHARS, GrammarSpec
from router import grpc_service
from router.core import RouterConfig, RouterCore
from router.openai_schema import APIError
from router.proto import pdserve_pb2 as pb
from tests.unit.router.scripted import ScriptedDispatcher, default_grammar_compiler, tools_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


class Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> Any:
        return ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, None),
        ({"json_schema": json.dumps(SCHEMA)}, GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))),
        ({"json_object": True}, GrammarSpec(kind="json_object")),
        ({"json_object": False}, None),
        ({"regex": "[0-9]+"}, GrammarSpec(kind="regex", text="[0-9]+")),
        ({"grammar": 'root ::= "x"'}, GrammarSpec(kind="ebnf", text='root ::= "x"')),
        ({"choice": pb.Choices(options=["yes", "no"])}, GrammarSpec(kind="ebnf", text='root ::= "yes" | "no"')),
        ({"structural_tag": '{"type": "structural_tag"}'},
         GrammarSpec(kind="structural_tag", text='{"type": "structural_tag"}')),
    ],
)
def test_each_constraint_becomes_its_grammar(options, expected):
    source = grpc_service.grammar_of(pb.SamplingOptions(**options))
    assert (source and source.spec) == expected
    if source is not None:
        assert source.field == f"sampling.{next(iter(options))}"


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"json_schema": "[1]"}, "sampling.json_schema", "must be a JSON object, not an array"),
        ({"json_schema": "{nope"}, "sampling.json_schema", "is not valid JSON"),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "sampling.regex", f"at most {MAX_GRAMMAR_CHARS} are allowed"),
        ({"choice": pb.Choices()}, "sampling.choice", "at least one"),
        ({"grammar": ""}, "sampling.grammar", "is empty"),
    ],
)
def test_a_bad_constraint_names_its_field(options, field, words):
    with pytest.raises(APIError) as err:
        grpc_service.grammar_of(pb.SamplingOptions(**options))
    assert err.value.status_code == 400 and err.value.param == field
    assert err.value.message.startswith(f"{field}: ") and words in err.value.message


@pytest.mark.parametrize(("sampling", "field", "words"), [
    (pb.SamplingOptions(max_tokens=8, logprobs=50), "sampling.logprobs", "(got 50)"),
])
def test_a_bad_sampling_option_is_named_as_the_proto_names_it_with_the_value_sent(sampling, field, words):
    with pytest.raises(APIError) as err:
        grpc_service.to_completion_request(pb.GenerateRequest(text="hi", sampling=sampling))
    assert err.value.status_code == 400 and err.value.param == field
    assert err.value.message.startswith(f"{field}: ") and words in err.value.message
    assert "Value error" not in err.value.message


def _generate(core: RouterCore, request: pb.GenerateRequest) -> tuple[list[Any], Context]:
    context = Context()

    async def run() -> list[Any]:
        return [r async for r in grpc_service.generate(core, request, context)]

    return asyncio.run(run()), context


def test_generate_constrains_and_refuses_what_does_not_compile():
    tokenizer, compiler = tools_tokenizer(), default_grammar_compiler()
    dispatcher = ScriptedDispatcher(tokenizer)
    dispatcher.text = "42"
    core = RouterCore(dispatcher, tokenizer, RouterConfig(), 2048,  # type: ignore[arg-type]
                      grammar_compiler=lambda: compiler)
    sampling = pb.SamplingOptions(max_tokens=4, regex="[0-9]+")
    out, context = _generate(core, pb.GenerateRequest(text="hi", sampling=sampling))
    assert context.code is None and "".join(r.text for r in out) == "42"
    assert dispatcher.requests[-1][1].grammar == GrammarSpec(kind="regex", text="[0-9]+")

    out, context = _generate(core, pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(regex="(abc")))
    assert out == [] and context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("sampling.regex: the regex does not compile: Regex parsing error")
    out, context = _generate(core, pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(json_schema="[1]")))
    assert out == [] and context.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.json_schema" in context.details
    assert len(dispatcher.requests) == 1 and core.num_in_flight == 0
