"""OpenAI function calling in the Hermes/Qwen3 format: the model writes each call as

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

This module holds both ends of that format: the grammar that makes a model write it (xgrammar's
"qwen_3" structural tag, built from the request's tools and tool_choice) and the parser that reads
calls back out of the output, whole or as it streams.

What it does not know: request models, HTTP, or chat templates (the template tells the model
about the tools; RouterCore passes them to it).
"""

from __future__ import annotations

import importlib
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from router.structured import GrammarFieldError, GrammarSource, structural_tag

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
STRUCTURAL_TAG_MODEL = "qwen_3"
"""xgrammar's name of the format above (get_model_structural_tag); the parser below reads the same."""
MAX_ARGUMENT_WHITESPACE = 16
"""Longest whitespace run between JSON tokens of a call's arguments: enough to indent them, and a
bound, so that a model cannot spend its max_tokens on whitespace and leave the call unfinished
(engine/grammar.py's json_schema allows none for the same reason)."""

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools and what it asked of them."""

    tools: list[dict[str, Any]]  # OpenAI function tools, {"type": "function", "function": {...}}: the template's
    mode: ToolChoiceMode  # "function": the one tool named by `name` must be called
    name: str | None = None
    is_parallel: bool = True  # False: at most one call (OpenAI's parallel_tool_calls)

    @property
    def is_active(self) -> bool:
        """Whether the model may call tools (the output is constrained and parsed for calls)."""
        return self.mode != "none"

    @property
    def finish_reason_of_calls(self) -> str:
        """OpenAI's finish_reason of an output that called tools: a forced call ends as 'stop'."""
        return "stop" if self.mode == "function" else "tool_calls"

    def grammar(self) -> GrammarSource | None:
        """The structural tag that keeps calls to the tools' names and parameter schemas; None for
        mode 'none'. A choice xgrammar refuses is a GrammarFieldError naming `tools`."""
        if not self.is_active:
            return None
        import xgrammar as xgr  # NOTE: imported on a thread when the router starts (preload_xgrammar)

        choice: Any = self.mode if self.mode != "function" else {"type": "function", "function": {"name": self.name}}
        try:
            tag = xgr.get_model_structural_tag(
                STRUCTURAL_TAG_MODEL, tools=self.tools, tool_choice=choice, reasoning="disabled",
                parallel_tool_calls=self.is_parallel, max_whitespace_cnt=MAX_ARGUMENT_WHITESPACE,
            )
        except (ValueError, TypeError) as err:
            raise GrammarFieldError("tools", f"tools: {err}") from None
        return structural_tag(tag.model_dump_json(), "tools")


def preload_xgrammar() -> None:
    """Imports xgrammar on a daemon thread: the import takes most of a second, which the first
    request with tools would otherwise spend on the event loop. A machine without it serves all but
    grammars."""

    def load() -> None:
        try:
            importlib.import_module("xgrammar")
        except ImportError:
            pass

    threading.Thread(target=load, name="xgrammar-import", daemon=True).start()


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_<24 hex digits>"
    name: str
    arguments: str  # JSON text of the arguments object (OpenAI sends arguments as a string)


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str) -> ToolCall | None:
    """A block's body as a call; None when it is not {"name": str, "arguments"?: object}."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(_new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_start(text: str) -> int:
    """Length of the longest tail of text that is a proper prefix of TOOL_CALL_START."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """One choice's output, split into content and calls as it arrives.

    Invariants: `_pending` is text not yet returned; it is either a tail that may begin a
    TOOL_CALL_START, or starts with TOOL_CALL_START (an open block). Whitespace after the last
    content returned waits in `_held_space` until more content follows, so a blank gap between
    calls never becomes content: fed whole or in pieces, the output splits the same way.
    A block that does not parse as a call is content, as is an unclosed one at the end.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._held_space = ""
        self.is_content_sent = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this text)."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            if not self._pending.startswith(TOOL_CALL_START):
                start = self._pending.find(TOOL_CALL_START)
                if start == -1:
                    start = len(self._pending) - _partial_start(self._pending)
                content.append(self._content(self._pending[:start]))
                self._pending = self._pending[start:]
                if not self._pending.startswith(TOOL_CALL_START):
                    break  # empty, or a partial start held back
            end = self._pending.find(TOOL_CALL_END, len(TOOL_CALL_START))
            if end == -1:
                break  # an open block: held back until it closes
            block, self._pending = self._pending[: end + len(TOOL_CALL_END)], self._pending[end + len(TOOL_CALL_END):]
            call = _parse_call(block[len(TOOL_CALL_START): -len(TOOL_CALL_END)])
            if call is None:
                content.append(self._content(block))
            else:
                calls.append(call)
        self.num_calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """The content still held back, at the end of the output."""
        out = self._content(self._pending)
        self._pending = ""
        if self.is_content_sent:
            out += self._held_space
        self._held_space = ""
        return out

    def _content(self, piece: str) -> str:
        if not piece:
            return ""
        text = self._held_space + piece
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        if kept:
            self.is_content_sent = True
        return kept


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content outside the call blocks, None when blank; the calls in order)."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    content += stream.finish()
    return content or None, calls
