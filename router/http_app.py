"""build_http_app(core): the OpenAI-compatible HTTP front end, a FastAPI app. /v1/completions and
/v1/chat/completions (JSON, or SSE streaming as OpenAI frames it), /v1/models, /health; the API key
check, the request body limit, and an OpenAI error body for every failure (never a bare 500 page).

What it knows: HTTP, SSE framing, and how ChoiceDeltas become OpenAI responses and chunks (a chat
output's tool calls parsed out of its text by router/tool_calls.py, each streamed whole). What it
does not know: tokenizers, limits or workers (RouterCore owns those), Ray Serve (the deployment
wraps this app as its ingress), or metrics backends (it calls `core.metrics.on_response` when set).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import openai_schema as oai
from router.core import ChoiceDelta, RouterCore
from router.openai_schema import APIError, UsageInfo, bad_request
from router.tool_calls import ToolCalling, ToolCallStream, parse_tool_calls

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
UNAUTHENTICATED_ROUTES = ("/health",)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def build_http_app(core: RouterCore, router_id: str = "router") -> FastAPI:
    """router_id: named by /health, so that a client can tell which router replica answered."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Gate, core=core)

    async def on_api_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, APIError)
        return _error(err)

    async def on_http_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, StarletteHTTPException)
        return _error(APIError(err.status_code, f"{err.detail}: {request.method} {request.url.path}"))

    async def on_internal_error(request: Request, err: Exception) -> Response:
        log.error("internal error on %s", request.url.path, exc_info=err)
        return _error(APIError(500, f"internal error: {type(err).__name__}", type="server_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)

    @app.get("/health")
    async def health() -> Response:
        return Response(json.dumps({"status": "ok", "router": router_id}), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        render = getattr(core.metrics, "render", None)
        if render is None:
            raise APIError(404, "metrics are not enabled on this server", code="not_found")
        return Response(await render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/requests/{request_id}/trace")
    async def trace(request_id: str) -> Response:
        spans = core.spans.find(request_id)
        if not spans:
            raise APIError(404, f"request_id: no recent request {request_id!r} (the last "
                           f"{core.spans.max_requests} are kept)", param="request_id", code="not_found")
        return Response(json.dumps({"request_id": request_id, "choices": spans}), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        card = oai.ModelCard(id=core.config.model_name, max_model_len=core.max_model_len)
        return _json(oai.ModelList(data=[card]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = oai.CompletionRequest.parse(await _read_json(request, core.config.max_body_bytes))
        core.check_model(body.model)
        prompts = core.encode_prompts(body.prompt)
        params = core.sampling_params(body, prompts)
        await core.check_grammar(body.grammar)
        render = _CompletionRender(core, f"cmpl-{uuid.uuid4().hex}", len(prompts) * body.n, params.logprobs)
        stream = core.generate_prompts(render.id, prompts, params, body.n)
        return await _respond(request, stream, render, body.stream, body.include_usage, sum(map(len, prompts)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = oai.ChatCompletionRequest.parse(await _read_json(request, core.config.max_body_bytes))
        core.check_model(body.model)
        calling = body.tool_calling
        prompt = core.encode_chat(body.template_messages(), body.add_generation_prompt,
                                  None if calling is None else calling.tools)
        params = core.sampling_params(body, [prompt])
        await core.check_grammar(body.grammar)
        is_calling = calling is not None and calling.is_active
        render = _ChatRender(core, f"chatcmpl-{uuid.uuid4().hex}", body.n, params.logprobs,
                             calling if is_calling else None)
        stream = core.generate(render.id, prompt, params, body.n)
        return await _respond(request, stream, render, body.stream, body.include_usage, len(prompt))

    return app


# ---- the gate: API key and the metrics hook, for every route


class _Gate:
    """Pure ASGI middleware (it never buffers a streamed body): refuses a missing or wrong API key
    with 401, and reports each response to `core.metrics.on_response`."""

    def __init__(self, app: ASGIApp, core: RouterCore) -> None:
        self.app = app
        self.core = core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 500

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await _error(refusal)(scope, receive, send_observed)
            else:
                await self.app(scope, receive, send_observed)
        finally:
            if self.core.metrics is not None:
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.core.metrics.on_response(route=route, status_code=status, elapsed_s=time.monotonic() - started)

    def _refusal(self, scope: Scope) -> APIError | None:
        key = self.core.config.api_key
        if key is None or scope["path"] in UNAUTHENTICATED_ROUTES:
            return None
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
            return None
        if not header:
            message = "missing API key: send the header 'Authorization: Bearer <key>'"
            return APIError(401, message, code="invalid_api_key")
        return APIError(401, "incorrect API key provided", code="invalid_api_key")


# ---- bodies and responses


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refused with 413 past `max_bytes` (counted as it arrives, so a missing
    or false Content-Length changes nothing) and with 400 when it is not UTF-8 JSON."""
    too_large = APIError(413, f"request body is larger than max_body_bytes = {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("request body is empty: send a JSON object")
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8: byte {body[err.start]:#04x} at {err.start}") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise bad_request(f"request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {type(data).__name__}")
    if _MAY_NEED_CHECK.search(body):  # NOTE: one C scan of the body; the walk only when it may find something
        for field, value in data.items():
            _check_value(value, str(field))
    return data


_INT64 = (-(1 << 63), (1 << 63) - 1)
# What a lone surrogate or an integer past 64 bits needs in JSON text: a \uD800-\uDFFF escape, 19 digits.
_MAY_NEED_CHECK = re.compile(rb"\\u[dD][89a-fA-F]|[0-9]{19}")


def _check_value(value: Any, field: str) -> None:
    """What valid JSON may hold and no field of ours takes: a string with a lone UTF-16 surrogate
    (not text: it cannot be encoded) and an integer outside 64 bits. Refused naming the top-level field."""
    stack = [value]
    while stack:  # NOTE: iterative: json.loads already bounded the depth, a recursion here would not be
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise bad_request(f"{field}: holds a lone surrogate ({item[err.start]!r} at {err.start}), "
                                      "which is not text: send valid Unicode", param=field) from None
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not _INT64[0] <= item <= _INT64[1]:
                raise bad_request(f"{field}: {item} is out of range: integers must be at least {_INT64[0]} and at "
                                  f"most {_INT64[1]}", param=field)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _json(model: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json", headers=headers)


def _error(err: APIError) -> Response:
    return _json(err.to_body(), err.status_code, err.headers)


_SENTINEL = "\ue000pdserve-text\ue001"  # NOTE: private-use characters: no token text renders a chunk around it


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _respond(
    request: Request, stream: AsyncIterator[ChoiceDelta], render: _Render, is_streaming: bool,
    include_usage: bool, num_prompt_tokens: int,
) -> Response:
    if not is_streaming:
        deltas = await _collect_unless_disconnected(request, stream)
        if deltas is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        usage = _usage(num_prompt_tokens, {d.index: d.num_completion_tokens for d in deltas})
        return _json(render.response(deltas, usage))
    # NOTE: wait for the first delta before answering, so that what fails before the first token
    # (429, 503, a worker refusing the prompt) gets its own status instead of an error event.
    first = await anext(stream, None)
    events = _events(first, stream, render, include_usage, num_prompt_tokens)
    return _EventStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(num_prompt_tokens: int, num_completion_tokens_of: dict[int, int]) -> UsageInfo:
    num_completion_tokens = sum(num_completion_tokens_of.values())  # choice index -> its tokens
    return UsageInfo(
        prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


async def _collect_unless_disconnected(
    request: Request, stream: AsyncIterator[ChoiceDelta]
) -> list[ChoiceDelta] | None:
    """All deltas; or None when the client leaves first, after closing the stream (which aborts)."""

    async def collect() -> list[ChoiceDelta]:
        async with aclosing(stream):  # type: ignore[type-var]
            return [d async for d in stream]

    async def disconnected() -> None:
        # The body is read: the next message is http.disconnect, when the client goes away.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
    return collector.result() if collector.done() and not collector.cancelled() else None


async def _events(
    first: ChoiceDelta | None, stream: AsyncIterator[ChoiceDelta], render: _Render, include_usage: bool,
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    num_completion_tokens_of: dict[int, int] = {}  # choice index -> its running total
    async with aclosing(stream):  # type: ignore[type-var]
        for chunk in render.opening():
            yield _sse(chunk)
        try:
            delta = first
            while delta is not None:
                num_completion_tokens_of[delta.index] = delta.num_completion_tokens
                event = render.event(delta)
                if event is not None:
                    yield event
                delta = await anext(stream, None)
        except APIError as err:
            yield _sse(err.to_body())
        except Exception as err:  # noqa: BLE001 - the headers are sent: report it as OpenAI does, in the stream
            log.error("stream %s failed", render.id, exc_info=err)
            yield _sse(APIError(500, f"internal error: {type(err).__name__}", type="server_error").to_body())
        else:
            if include_usage:
                yield _sse(render.usage_chunk(_usage(num_prompt_tokens, num_completion_tokens_of)))
        yield SSE_DONE


class _EventStream(StreamingResponse):
    """Closes its events however the response ends (Starlette closes them only by cancellation,
    and only on ASGI servers older than spec 2.4), so a vanished client's request is aborted."""

    def __init__(self, events: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(events, **kwargs)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


# ---- ChoiceDeltas -> OpenAI's responses and chunks


class _Render:
    """Shared by both APIs: the response id and creation time, the choice count, logprobs wanted."""

    def __init__(self, core: RouterCore, response_id: str, num_choices: int, logprobs: int | None) -> None:
        self.core = core
        self.id = response_id
        self.head = {"id": response_id, "created": int(time.time()), "model": core.config.model_name}
        self.num_choices = num_choices
        self.is_logprobs = logprobs is not None
        self._templates: dict[int, tuple[str, str] | None] = {}  # choice index -> see event()

    def opening(self) -> list[BaseModel]:
        return []

    def event(self, delta: ChoiceDelta) -> str | None:
        """The SSE event of a delta, None for a delta that adds nothing. A choice's text mid-stream (no
        finish, no logprobs: most events) goes into its chunk's JSON as rendered once per choice index,
        byte for byte what the model would give (pydantic's own string encoding) at a fraction of the CPU."""
        if delta.text and delta.finish_reason is None and not self.is_logprobs:
            if delta.index not in self._templates:
                self._templates[delta.index] = self._text_template(delta.index)
            template = self._templates[delta.index]
            if template is not None:
                return template[0] + to_json(delta.text).decode() + template[1]
        chunk = self.chunk(delta)
        return _sse(chunk) if chunk is not None else None

    def _text_template(self, index: int) -> tuple[str, str] | None:
        """The SSE event of a mid-stream text delta of choice INDEX split around its JSON-encoded text (the
        chunk of a sentinel text, split at it); None where the text does not go into the chunk as it is."""
        chunk = self.chunk(ChoiceDelta(index=index, text=_SENTINEL, token_ids=[], logprobs=None, top_logprobs=None,
                                       finish_reason=None, stop_reason=None, num_prompt_tokens=0,
                                       num_completion_tokens=0, num_cached_tokens=0))
        if chunk is None:
            return None
        before, found, after = _sse(chunk).partition(to_json(_SENTINEL).decode())
        return (before, after) if found and _SENTINEL not in after else None

    def _is_news(self, delta: ChoiceDelta) -> bool:
        return bool(delta.text) or delta.finish_reason is not None or (self.is_logprobs and bool(delta.token_ids))

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def response(self, deltas: list[ChoiceDelta], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def _by_choice(self, deltas: list[ChoiceDelta]) -> list[list[ChoiceDelta]]:
        choices: list[list[ChoiceDelta]] = [[] for _ in range(self.num_choices)]
        for d in deltas:
            choices[d.index].append(d)
        return choices


class _CompletionRender(_Render):
    def __init__(self, core: RouterCore, response_id: str, num_choices: int, logprobs: int | None) -> None:
        super().__init__(core, response_id, num_choices, logprobs)
        self.text_offsets = [0] * num_choices  # per choice: characters of token text before the next token

    def _logprobs(self, delta: ChoiceDelta) -> oai.CompletionLogprobs | None:
        if not self.is_logprobs or delta.logprobs is None:
            return None
        out = oai.CompletionLogprobs(token_logprobs=list(delta.logprobs))
        for i, token in enumerate(delta.token_ids):
            text = self.core.token_text(token)
            out.tokens.append(text)
            out.text_offset.append(self.text_offsets[delta.index])
            self.text_offsets[delta.index] += len(text)
            top = delta.top_logprobs[i] if delta.top_logprobs is not None else []
            out.top_logprobs.append({self.core.token_text(t): lp for t, lp in top})
        return out

    def _choice(self, deltas: list[ChoiceDelta], index: int) -> oai.CompletionChoice:
        parts = [p for p in (self._logprobs(d) for d in deltas) if p is not None]
        logprobs = None
        if parts:
            logprobs = oai.CompletionLogprobs()
            for p in parts:
                for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(logprobs, field).extend(getattr(p, field))
        last = deltas[-1] if deltas else None
        return oai.CompletionChoice(
            index=index, text="".join(d.text for d in deltas), logprobs=logprobs,
            finish_reason=last.finish_reason if last else None, stop_reason=last.stop_reason if last else None,
        )

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        if not self._is_news(delta):
            return None
        choice = self._choice([delta], delta.index)
        return oai.CompletionResponse(**self.head, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return oai.CompletionResponse(**self.head, choices=[], usage=usage)

    def response(self, deltas: list[ChoiceDelta], usage: UsageInfo) -> BaseModel:
        choices = [self._choice(ds, i) for i, ds in enumerate(self._by_choice(deltas))]
        return oai.CompletionResponse(**self.head, choices=choices, usage=usage)


class _ChatRender(_Render):
    """With tool calling, each choice's text goes through a ToolCallStream: text from a
    `<tool_call>` on is held back, and each completed call is sent whole, in one delta."""

    def __init__(
        self, core: RouterCore, response_id: str, num_choices: int, logprobs: int | None,
        calling: ToolCalling | None = None,
    ) -> None:
        super().__init__(core, response_id, num_choices, logprobs)
        self.calling = calling
        self.streams = [ToolCallStream() for _ in range(num_choices)] if calling is not None else None

    def _text_template(self, index: int) -> tuple[str, str] | None:
        # NOTE: with tool calling a choice's text goes through its ToolCallStream (stateful): never a sentinel
        return None if self.streams is not None else super()._text_template(index)

    def _finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        if self.calling is not None and num_calls and finish_reason == "stop":
            return self.calling.finish_reason_of_calls
        return finish_reason

    def _entry(self, token: int, logprob: float) -> oai.ChatLogprob:
        text = self.core.token_text(token)
        return oai.ChatLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _logprobs(self, deltas: list[ChoiceDelta]) -> oai.ChatChoiceLogprobs | None:
        if not self.is_logprobs:
            return None
        content: list[oai.ChatTokenLogprob] = []
        for d in deltas:
            for i, token in enumerate(d.token_ids):
                top = d.top_logprobs[i] if d.top_logprobs is not None else []
                entry = self._entry(token, d.logprobs[i] if d.logprobs is not None else 0.0)
                alternatives = [self._entry(*t) for t in top]
                content.append(oai.ChatTokenLogprob(**entry.model_dump(), top_logprobs=alternatives))
        return oai.ChatChoiceLogprobs(content=content)

    def _chunk(self, choices: list[oai.ChatStreamChoice], usage: UsageInfo | None = None) -> oai.ChatCompletionChunk:
        return oai.ChatCompletionChunk(**self.head, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        # NOTE: no content '' with tool calling: a reply of calls alone has content null, as OpenAI's
        role = oai.DeltaMessage(role="assistant", content="" if self.streams is None else None)
        return [self._chunk([oai.ChatStreamChoice(index=i, delta=role)]) for i in range(self.num_choices)]

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        if not self._is_news(delta):
            return None
        content, calls, finish_reason = delta.text, [], delta.finish_reason
        if self.streams is not None:
            stream = self.streams[delta.index]
            first_index = stream.num_calls
            content, new_calls = stream.feed(delta.text)
            if delta.finish_reason is not None:
                content += stream.finish()
            calls = [oai.ToolCallDelta.at(first_index + i, c) for i, c in enumerate(new_calls)]
            finish_reason = self._finish_reason(finish_reason, stream.num_calls)
            if not (content or calls or finish_reason or (self.is_logprobs and delta.token_ids)):
                return None  # all of it held back
        message = oai.DeltaMessage(content=content or None, tool_calls=calls or None)
        choice = oai.ChatStreamChoice(
            index=delta.index, delta=message, logprobs=self._logprobs([delta]), finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
        )
        return self._chunk([choice])

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._chunk([], usage)

    def _message(self, text: str) -> tuple[oai.ChatResponseMessage, int]:
        """The message of a choice's whole text, and its number of tool calls."""
        if self.calling is None:
            return oai.ChatResponseMessage(content=text), 0
        content, calls = parse_tool_calls(text)
        tool_calls = [oai.ToolCallOut.of(c) for c in calls] or None
        return oai.ChatResponseMessage(content=content, tool_calls=tool_calls), len(calls)

    def response(self, deltas: list[ChoiceDelta], usage: UsageInfo) -> BaseModel:
        choices = []
        for i, ds in enumerate(self._by_choice(deltas)):
            message, num_calls = self._message("".join(d.text for d in ds))
            choices.append(oai.ChatCompletionChoice(
                index=i, message=message, logprobs=self._logprobs(ds),
                finish_reason=self._finish_reason(ds[-1].finish_reason, num_calls) if ds else None,
                stop_reason=ds[-1].stop_reason if ds else None,
            ))
        return oai.ChatCompletionResponse(**self.head, choices=choices, usage=usage)
