"""OpenAI request bodies -> SamplingParams: every field lands where it belongs, unknown fields are
ignored, and each bad value is a 400 whose message names the field (as the client spelled it), the
limit, and the value sent."""

from __future__ import annotations

from typing import Any

import pytest

from engine import SamplingParams
from router.openai_schema import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionRequest,
    DeltaMessage,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _completion(**fields: Any) -> SamplingParams:
    return CompletionRequest.parse({"prompt": "hi", **fields}).to_sampling_params()


def _chat(default_max_tokens: int = 100, **fields: Any) -> SamplingParams:
    return ChatCompletionRequest.parse({**CHAT, **fields}).to_sampling_params(default_max_tokens)


def test_completion_fields_map_to_sampling_params():
    params = _completion(
        max_tokens=7, temperature=0.5, top_p=0.9, stop="\n", seed=3, logprobs=2, presence_penalty=0.5,
        frequency_penalty=-0.5, top_k=20, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2,
        stop_token_ids=[5, 6], include_stop_str_in_output=True,
    )
    assert params == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, stop=("\n",), seed=3, logprobs=2, presence_penalty=0.5,
        frequency_penalty=-0.5, top_k=20, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2,
        stop_token_ids=(5, 6), include_stop_str_in_output=True,
    )


def test_completion_defaults_are_openai_defaults():
    assert _completion() == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    assert CompletionRequest.parse({"prompt": "hi"}).to_sampling_params(5).max_tokens == 5


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_shapes(prompt, expected):
    assert CompletionRequest.parse({"prompt": prompt}).prompt == expected


def test_unknown_and_empty_known_fields_are_ignored():
    request = CompletionRequest.parse(
        {"prompt": "hi", "future_field": {"x": [1]}, "logit_bias": {}, "best_of": 1, "stream_options": None}
    )
    assert request.to_sampling_params() == SamplingParams()
    chat = ChatCompletionRequest.parse({**CHAT, "tool_choice": "none", "tools": [], "parallel_tool_calls": False})
    assert chat.messages[0].content == "hi"


def test_chat_fields_map_to_sampling_params():
    assert _chat(max_tokens=5).max_tokens == 5
    assert _chat(max_tokens=5, max_completion_tokens=9).max_tokens == 9  # the newer name wins
    assert _chat().max_tokens == 100  # the caller's default: the room left in the context
    assert _chat().logprobs is None
    assert _chat(logprobs=True).logprobs == 0
    assert _chat(logprobs=True, top_logprobs=4).logprobs == 4
    assert _chat(stop=["a", "b"]).stop == ("a", "b")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatCompletionRequest.parse({"messages": [{"role": "user", "content": parts}]}).messages[0].content == "a\nb"


def test_include_usage_needs_stream():
    body = {"prompt": "hi", "stream_options": {"include_usage": True}}
    assert not CompletionRequest.parse(body).include_usage
    assert CompletionRequest.parse({**body, "stream": True}).include_usage


def _error(make: Any) -> APIError:
    with pytest.raises(APIError) as err:
        make()
    assert err.value.status_code == 400
    return err.value


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1 (got 0)"),
        ({"temperature": 101}, "temperature", "less than or equal to 100 (got 101"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"min_p": 2}, "min_p", "less than or equal to 1"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
        ({"stop": ["x"] * 17}, "stop", "at most 16"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"stop": 5}, "stop", "valid list"),
        ({"max_tokens": "16"}, "max_tokens", "valid integer"),
        ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"echo": True}, "echo", "not supported"),
        ({"suffix": "end"}, "suffix", "not supported"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
        ({"prompt": []}, "prompt", "non-empty"),
        ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({"prompt": [[1], []]}, "prompt", "list of token-id lists"),
        ({"prompt": [True]}, "prompt", "list of token ids"),
    ],
)
def test_bad_completion_field_names_field_and_limit(fields, param, words):
    err = _error(lambda: _completion(**fields))
    assert err.param == param
    assert err.message.startswith(f"{param}: ") and words in err.message
    assert err.to_body().error.type == "invalid_request_error"


def test_missing_prompt_and_min_tokens_over_max_tokens():
    err = _error(lambda: CompletionRequest.parse({}))
    assert (err.param, err.message) == ("prompt", "prompt: Field required")
    err = _error(lambda: _completion(max_tokens=3, min_tokens=5))
    assert "min_tokens (5) must be at most max_tokens (3)" in err.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs=true"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": "hi"}, "messages", "valid list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "text parts"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "Field required"),
        ({"response_format": {"type": "image"}}, "response_format.type", "'json_object'"),
    ],
)
def test_bad_chat_field_names_field_and_limit(fields, param, words):
    err = _error(lambda: _chat(**fields))
    assert err.param == param
    assert err.message.startswith(f"{param}: ") and words in err.message


def test_chat_delta_omits_absent_keys():
    chunk = ChatCompletionChunk(id="x", model="m", choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="a"))])
    assert '"delta":{"content":"a"}' in chunk.model_dump_json()
    assert DeltaMessage().model_dump_json() == "{}"
