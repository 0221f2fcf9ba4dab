"""Chat messages -> prompt text with the checkpoint's template, and with the request's tools when it
has some (templates that know tools, Qwen's and Hermes', write them into the system turn).

NOTE: engine/tokenizer.py's `Tokenizer.apply_chat_template` does not take `tools` yet, so a request
with tools renders the same compiled template here, with `tools` among its variables; without
tools it is the tokenizer's own call. Once apply_chat_template takes `tools`, this module is one
call to it and goes.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2

from engine.tokenizer import Tokenizer, _compile_chat_template


@functools.lru_cache(maxsize=4)
def _template(source: str) -> jinja2.Template:
    return _compile_chat_template(source)


def apply_chat_template(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text (not tokenized). Raises what the template raises, or ValueError when the
    checkpoint has no template."""
    source = tokenizer._chat_template_source
    if not tools or source is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt)
    # the variables of Tokenizer.apply_chat_template, and tools
    return _template(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "", tools=tools,
    )
