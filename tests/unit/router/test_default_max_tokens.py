"""What a request without max_tokens gets (README.md says the same): a completion 16 tokens
(OpenAI's default); a chat completion the room its prompt leaves in max_model_len, capped at
RouterConfig.max_tokens_limit, so that it never runs for tens of thousands of tokens on a long-context
model. A limit asked above max_tokens_limit, or past the room, is a 400 naming the field."""

from __future__ import annotations

import pytest

from router.core import RouterConfig, RouterCore
from router.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tests.unit.router.scripted import ScriptedDispatcher, tools_tokenizer

MESSAGES = [{"role": "user", "content": "Tell me everything."}]


def _core(max_model_len: int, **config: int) -> RouterCore:
    tokenizer = tools_tokenizer()
    dispatcher = ScriptedDispatcher(tokenizer)
    return RouterCore(dispatcher, tokenizer, RouterConfig(**config), max_model_len)  # type: ignore[arg-type]


def _chat_max_tokens(core: RouterCore, **fields: int) -> int:
    request = ChatCompletionRequest.parse({"messages": MESSAGES, **fields})
    prompt = core.encode_chat(request.template_messages())
    return core.sampling_params(request, [prompt]).max_tokens


@pytest.mark.parametrize("max_model_len", [40_960, 131_072])
def test_a_chat_without_max_tokens_on_a_long_context_stops_at_max_tokens_limit(max_model_len):
    core = _core(max_model_len)
    assert core.config.max_tokens_limit == 4096
    assert _chat_max_tokens(core) == 4096
    assert _chat_max_tokens(_core(max_model_len, max_tokens_limit=300)) == 300


def test_a_chat_without_max_tokens_on_a_short_context_gets_the_room_left():
    core = _core(2048)
    prompt = core.encode_chat(MESSAGES)
    assert _chat_max_tokens(core) == 2048 - len(prompt) < core.config.max_tokens_limit


def test_a_completion_without_max_tokens_gets_openais_16():
    core = _core(40_960)
    request = CompletionRequest.parse({"prompt": "hi"})
    assert core.sampling_params(request, core.encode_prompts(request.prompt)).max_tokens == 16


def test_an_asked_limit_is_kept_and_one_over_max_tokens_limit_is_refused():
    core = _core(40_960)
    assert _chat_max_tokens(core, max_tokens=4000) == 4000
    assert _chat_max_tokens(core, max_completion_tokens=4096) == 4096
    with pytest.raises(APIError) as err:
        _chat_max_tokens(core, max_completion_tokens=4097)
    assert err.value.status_code == 400 and err.value.param == "max_completion_tokens"
    assert "4097 is more than this server's limit of 4096 tokens" in err.value.message


def test_an_asked_limit_past_the_room_left_is_refused_naming_the_field():
    core = _core(2048)
    room = 2048 - len(core.encode_chat(MESSAGES))
    assert _chat_max_tokens(core, max_tokens=room) == room
    with pytest.raises(APIError) as err:
        _chat_max_tokens(core, max_tokens=room + 1)
    assert err.value.status_code == 400 and err.value.param == "max_tokens"
    assert f"at most {room} can be generated" in err.value.message
