"""OpenAI's wire format: request bodies of /v1/completions and /v1/chat/completions (with vLLM's
sampling extras), their responses and streaming chunks, /v1/models, the error body, and the
conversion of a request into the engine's SamplingParams.

What it knows: field names, JSON types, OpenAI's defaults, and how a pydantic error becomes an
OpenAI error that names the field and the limit. What it does not know: tokenizers, the model's
or the router's limits (max_model_len, max_tokens_limit, max_n: router/core.py checks those),
HTTP, or the workers. Unknown request fields are ignored (clients send extras); known fields that
this server cannot honour (echo, suffix, logit_bias) are refused. The fields that constrain the
output (response_format, tools, vLLM's structured_outputs and guided_*) become one grammar through
router/structured.py and router/tool_calls.py; whether it compiles is RouterCore's check.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_serializer

from engine.config import MAX_LOGPROBS, SamplingParams
from router import structured
from router.structured import GrammarFieldError, GrammarSource
from router.tool_calls import ToolCall, ToolCalling

MAX_SEED = 2**63 - 1
"""Seeds are int64 (OpenAI's range); n > 1 adds the choice index to it."""

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions (chat defaults to the room left in the context, capped by
the router's max_tokens_limit)."""

UNSUPPORTED = {
    "echo": "echo=true is not supported by this server; send echo=false and prepend the prompt yourself",
    "suffix": "suffix (insertion) is not supported by this server; leave it out",
    "logit_bias": "logit_bias is not supported by this server; leave it out",
}
"""Known OpenAI fields this server cannot honour: refused when set to anything but their off value."""


# ---- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class APIError(Exception):
    """An error the client sees: an HTTP status and OpenAI's error body (gRPC maps the status)."""

    def __init__(
        self, status_code: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def from_validation_error(err: ValidationError, names: Mapping[str, str] | None = None) -> APIError:
    """A 400 naming the first bad field (renamed through `names`), the limit, and the value sent."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    if names and loc and isinstance(loc[0], str) and loc[0] in names:
        loc = (names[loc[0]], *loc[1:])
    param = _param_of(loc)
    message = str(first["msg"]).removeprefix("Value error, ")
    if param is not None:
        message = f"{param}: {message}"
        if first["type"] != "missing":
            shown = repr(first.get("input"))
            message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more invalid field(s)"
    return bad_request(message, param)


# ---- requests


class _Request(BaseModel):
    # strict: JSON types as sent ("3" is not an int, true is not 1); extra: OpenAI clients send extras.
    model_config = ConfigDict(extra="ignore", strict=True)

    @classmethod
    def parse(cls, data: Any) -> Self:
        """Validates a decoded JSON body; a bad field raises APIError(400) naming it."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise from_validation_error(err) from None


class StreamOptions(_Request):
    include_usage: bool = False


# ---- structured outputs: the fields that constrain the output


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: Any = Field(alias="schema")  # a JSON object; router/structured.py checks it
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self, field: str) -> GrammarSource | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return structured.json_object(field)
        if self.json_schema is None:
            raise GrammarFieldError(f"{field}.json_schema", f"{field}.json_schema: is required when type is "
                                    "'json_schema': send {'name': ..., 'schema': {...}}")
        return structured.json_schema(self.json_schema.schema_, f"{field}.json_schema.schema", is_text_allowed=False)


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: set one of its fields."""

    json_: Any = Field(None, alias="json")  # a JSON schema, or its JSON text
    regex: str | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect) with a `root` rule
    choice: list[str] | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # an xgrammar structural tag, as JSON text

    def grammars(self, field: str) -> list[GrammarSource | None]:
        return [
            None if self.json_ is None else structured.json_schema(self.json_, f"{field}.json"),
            None if self.regex is None else structured.regex(self.regex, f"{field}.regex"),
            None if self.grammar is None else structured.ebnf(self.grammar, f"{field}.grammar"),
            None if self.choice is None else structured.choice(self.choice, f"{field}.choice"),
            structured.json_object(f"{field}.json_object") if self.json_object else None,
            None if self.structural_tag is None else structured.structural_tag(self.structural_tag,
                                                                               f"{field}.structural_tag"),
        ]


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = []
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    # what the output must match: at most one of these (router/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None  # vLLM's older names of structured_outputs' fields; a schema or its JSON text
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator(*UNSUPPORTED, check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(UNSUPPORTED[str(info.field_name)])
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_tokens_asked(self) -> tuple[str, int | None]:
        """(the field the client used, its value or None)."""
        return "max_tokens", self.max_tokens

    @cached_property
    def grammar(self) -> GrammarSource | None:
        """The request's one output constraint and the field it came from; None without one. Raises
        APIError(400) naming the field (a bad schema, a text too long, two constraints)."""
        try:
            return structured.only_one(self._grammars())
        except GrammarFieldError as err:
            raise bad_request(str(err), err.field) from None

    def _grammars(self) -> list[GrammarSource | None]:
        return [
            None if self.response_format is None else self.response_format.grammar("response_format"),
            *([] if self.structured_outputs is None else self.structured_outputs.grammars("structured_outputs")),
            None if self.guided_json is None else structured.json_schema(self.guided_json, "guided_json"),
            None if self.guided_regex is None else structured.regex(self.guided_regex, "guided_regex"),
            None if self.guided_grammar is None else structured.ebnf(self.guided_grammar, "guided_grammar"),
            None if self.guided_choice is None else structured.choice(self.guided_choice, "guided_choice"),
        ]

    def _common_values(self) -> dict[str, Any]:
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
        }
        values = {k: v for k, v in values.items() if v is not None}
        grammar = self.grammar
        return values | {
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "include_stop_str_in_output": self.include_stop_str_in_output,
            "grammar": None if grammar is None else grammar.spec,
        }

    def _build(self, values: dict[str, Any], names: Mapping[str, str]) -> SamplingParams:
        try:
            return SamplingParams(**values)
        except ValidationError as err:
            raise from_validation_error(err, names) from None


def _are_token_ids(values: list[Any]) -> bool:
    """Every value a JSON integer (not a bool), in one pass in C: a Python test per id cost each long prompt
    tens of microseconds of the router's event loop."""
    return set(map(type, values)) == {int}


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalize_prompt(cls, value: Any) -> Any:
        """str | list[str] | list[int] | list[list[int]] -> list[str] | list[list[int]]."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if _are_token_ids(value):
                return [value]
            if all(isinstance(p, str) for p in value):
                return value
            if all(isinstance(p, list) and p and _are_token_ids(p) for p in value):
                return value
        raise ValueError("must be a non-empty string, list of strings, list of token ids, or list of token-id lists")

    def to_sampling_params(self, default_max_tokens: int = DEFAULT_COMPLETION_MAX_TOKENS) -> SamplingParams:
        values = self._common_values() | {"logprobs": self.logprobs}
        values["max_tokens"] = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return self._build(values, {})


class TextPart(_Request):
    type: Literal["text"]
    text: str


class CalledFunction(_Request):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; templates read an object

    @field_validator("arguments")
    @classmethod
    def _as_object(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except (json.JSONDecodeError, RecursionError) as err:
                raise ValueError(f"must be the JSON text of the arguments object: {err}") from None
            if not isinstance(parsed, dict):
                raise ValueError("must be the JSON text of an object")
            return parsed
        return value


class MessageToolCall(_Request):
    """A call an earlier assistant turn made (sent back with the tool's answer)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (its content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts: list[str] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} has type {kind!r}; only text parts {{'type': 'text', 'text': ...}} "
                                 "are supported")
            texts.append(part["text"])
        return "\n".join(texts)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # OpenAI's, and '.'
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: any object
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # 'none' | 'auto' | 'required' | {'type': 'function', 'function': {'name': ...}}
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM's extra

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or value in TOOL_CHOICES:
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            function = value.get("function")
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                return value
        raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")

    @cached_property
    def tool_calling(self) -> ToolCalling | None:
        """The tools and what the request asks of them; None without tools. Raises APIError(400)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):  # 'auto' without tools: nothing to call
                raise bad_request("tool_choice: needs tools; send the functions in tools, or leave tool_choice out",
                                  "tool_choice")
            return None
        names = [t.function.name for t in self.tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise bad_request(f"tools[{i}].function.name: {name!r} is given twice; tool names must be unique",
                                  f"tools[{i}].function.name")
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in names:
                raise bad_request(f"tool_choice: function {name!r} is not among tools ({', '.join(names)})",
                                  "tool_choice")
            return ToolCalling(tools, "function", name, is_parallel=parallel)
        return ToolCalling(tools, choice or "auto", is_parallel=parallel)

    def _grammars(self) -> list[GrammarSource | None]:
        calling = self.tool_calling
        return [*super()._grammars(), None if calling is None else calling.grammar()]

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them (transformers' shape): content '' when null, a name
        when given, and a call's arguments as an object."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.name is not None:  # the participant's name, for templates that render it
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    @property
    def max_tokens_asked(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs=true", "top_logprobs")
        name, asked = self.max_tokens_asked
        values = self._common_values()
        values["max_tokens"] = asked if asked is not None else default_max_tokens
        values["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return self._build(values, {"max_tokens": name, "logprobs": "top_logprobs"})


# ---- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's extra: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    """A /v1/completions response; a streaming chunk has the same shape (OpenAI's convention)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


CompletionStreamResponse = CompletionResponse


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallOut:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class ToolCallDelta(ToolCallOut):
    """A streamed call; this server sends each call whole, in one delta."""

    index: int  # the call's place in the choice's tool_calls

    @classmethod
    def at(cls, index: int, call: ToolCall) -> ToolCallDelta:
        return cls(index=index, **ToolCallOut.of(call).model_dump())


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_calls(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)  # the body of a request without tools stays as before
        return out


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # OpenAI omits absent keys


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
