"""Chat templates with tools (Tokenizer.apply_chat_template's `tools`): a request with tools renders
them into the prompt; one without renders as before."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.models import DEFAULT_MODEL_DIR
from engine.tokenizer import Tokenizer
from tests.unit.router.scripted import tools_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]


def test_tools_reach_the_template():
    tokenizer = tools_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, True, [TOOL])
    assert text.startswith(f"<|im_start|>system\n<tools>\n{json.dumps(TOOL)}\n</tools><|im_end|>\n")
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(MESSAGES, False, [TOOL]).endswith("Weather?<|im_end|>\n")


@pytest.mark.parametrize("tools", [None, []])
def test_without_tools_it_is_the_tokenizers_own_rendering(tools):
    tokenizer = tools_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, True, tools)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_a_tokenizer_without_a_template_says_so_with_or_without_tools():
    bare = Tokenizer(HFTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")))
    for tools in (None, [TOOL]):
        with pytest.raises(ValueError, match="this tokenizer has no chat template"):
            bare.apply_chat_template(MESSAGES, True, tools)
