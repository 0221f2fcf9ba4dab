"""Builders of the structured-output tests: a dispatcher that answers with a scripted text, the
default model's tokenizer with a Hermes-style chat template that writes tools, and that model's
grammar compiler."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.config import SamplingParams
from engine.grammar import GrammarCompiler
from engine.models import DEFAULT_MODEL_DIR
from engine.models.arch import load_arch
from engine.tokenizer import Tokenizer
from protocol.messages import TokenOutputMsg

EOS = 1
# The tools in a system turn, one JSON line each; an assistant's calls as <tool_call> blocks.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ScriptedDispatcher:
    """Answers every request with `text`'s tokens, one a step, then an end-of-sequence token; keeps
    each request's prompt and SamplingParams."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = "hello"
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        self.requests.append((list(prompt_token_ids), params))
        for token in self.tokenizer.encode(self.text, add_special_tokens=False):
            yield TokenOutputMsg(request_id, [token])
        yield TokenOutputMsg(request_id, [EOS], finish_reason="stop")

    async def close(self) -> None:
        pass


def tools_tokenizer() -> Tokenizer:
    hf = HFTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    return Tokenizer(hf, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", eos_token_ids=(EOS,),
                     chat_template=TOOLS_TEMPLATE, source_dir=DEFAULT_MODEL_DIR)


def default_grammar_compiler() -> GrammarCompiler:
    arch = load_arch(DEFAULT_MODEL_DIR)
    return GrammarCompiler(DEFAULT_MODEL_DIR, arch.vocab_size, arch.eos_token_ids)
