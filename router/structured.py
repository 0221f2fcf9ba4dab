"""Structured outputs from a request's fields: each way a client constrains the output (OpenAI's
response_format, vLLM's structured_outputs and guided_* extras, the gRPC SamplingOptions, and the
tool-call grammar of router/tool_calls.py) becomes one engine.config.GrammarSpec, paired with the
request field it came from, which a 400 names.

What it knows: how each form maps to a grammar kind, the text limit (MAX_GRAMMAR_CHARS), and that
one request carries at most one constraint. What it does not know: pydantic request models, HTTP,
or whether a grammar compiles (RouterCore.check_grammar compiles each once, off the event loop).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.config import MAX_GRAMMAR_CHARS, GrammarSpec

GRAMMAR_FIELDS = (
    "response_format, structured_outputs (one of json, regex, grammar, choice, json_object, structural_tag), "
    "guided_json, guided_regex, guided_grammar, guided_choice, or tools"
)
"""Every field that constrains the output, for the message that refuses two of them."""


@dataclass(frozen=True)
class GrammarSource:
    """A request's grammar and the field it came from, as the client spelled it (`structured_outputs.regex`)."""

    spec: GrammarSpec
    field: str


class GrammarFieldError(ValueError):
    """A constraint that cannot be honoured; the message starts with the field it names."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _source(kind: Literal["json_schema", "regex", "ebnf", "structural_tag"], text: str, field: str) -> GrammarSource:
    if not text:
        raise GrammarFieldError(field, f"{field}: is empty; send the {kind} text, or leave the field out")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarFieldError(
            field, f"{field}: is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS} are allowed "
            "(MAX_GRAMMAR_CHARS): shorten it",
        )
    return GrammarSource(GrammarSpec(kind=kind, text=text), field)


def json_schema(value: Any, field: str, is_text_allowed: bool = True) -> GrammarSource:
    """A JSON schema, sent as a JSON object or (is_text_allowed: vLLM's fields) as the JSON text of one."""
    if isinstance(value, str) and is_text_allowed:
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as err:
            raise GrammarFieldError(field, f"{field}: is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise GrammarFieldError(field, f"{field}: a JSON schema must be a JSON object, not {_json_type(value)}")
    return _source("json_schema", json.dumps(value, ensure_ascii=False), field)


def json_object(field: str) -> GrammarSource:
    """Any JSON object (OpenAI's JSON mode)."""
    return GrammarSource(GrammarSpec(kind="json_object"), field)


def regex(text: str, field: str) -> GrammarSource:
    return _source("regex", text, field)


def ebnf(text: str, field: str) -> GrammarSource:
    return _source("ebnf", text, field)


def structural_tag(text: str, field: str) -> GrammarSource:
    return _source("structural_tag", text, field)


def choice(choices: Sequence[str], field: str) -> GrammarSource:
    """Exactly one of the strings: an EBNF alternation of them as literals.

    NOTE: EBNF, not a regex: xgrammar's string literals take JSON's escapes, so json.dumps quotes
    any string exactly (ensure_ascii=False: its \\u escapes would split a character past U+FFFF
    into surrogates), while its regex dialect reads some of Python's re.escape escapes loosely."""
    if not choices:
        raise GrammarFieldError(field, f"{field}: is empty; list at least one string the output may be")
    return _source("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices), field)


def only_one(sources: Iterable[GrammarSource | None]) -> GrammarSource | None:
    """The request's one constraint, or None; two are refused, naming both."""
    given = [s for s in sources if s is not None]
    if len(given) > 1:
        first, second = given[0].field, given[1].field
        raise GrammarFieldError(
            first, f"{first} and {second}: both constrain the output; a request may set at most one of {GRAMMAR_FIELDS}"
        )
    return given[0] if given else None
