"""OpenAIStreamClient: sends one streaming request to an OpenAI-compatible server (/v1/completions or
/v1/chat/completions, with stream_options.include_usage) and times it: send, every chunk that
carries tokens, the end of the stream; token counts come from the usage chunk, never from the text.

A chunk carries tokens when one of its choices has text (completions), delta content (chat), or a
finish_reason; chat's opening chunk (role only, empty content) does not count. A request succeeds
when the stream ends with [DONE] after at least one token chunk and a usage chunk; anything else
(an HTTP error status, an error event in the stream, a dropped connection, a timeout) is a failed
record naming what happened.

Knows nothing of schedules or metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Self

import aiohttp

from loadgen.records import RequestRecord
from loadgen.workloads import BenchRequest

PATHS = {"completions": "/completions", "chat": "/chat/completions"}


def _error_message(body: str) -> str:
    """The message of an OpenAI error body, else the body itself (shortened)."""
    try:
        data = json.loads(body)
        message = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("error") or data
        return str(message)[:300]
    except (ValueError, AttributeError, KeyError, TypeError):
        return body.strip()[:300] or "(empty body)"


def _has_tokens(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content"))


class OpenAIStreamClient:
    """One aiohttp session for a run; `send(index, request, origin)` is the runner's SendFn."""

    def __init__(self, base_url: str, *, model: str, endpoint: str = "completions", api_key: str | None = None,
                 ignore_eos: bool = True, temperature: float | None = None, timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if endpoint not in PATHS:
            raise ValueError(f"endpoint must be one of {sorted(PATHS)}, got {endpoint!r}")
        self.url = base_url.rstrip("/") + PATHS[endpoint]
        self.model, self.endpoint, self.ignore_eos, self.temperature = model, endpoint, ignore_eos, temperature
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.clock = clock
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # NOTE: no connection limit: the runner's concurrency limit is the only one.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            if not isinstance(request.prompt, str):
                raise ValueError("endpoint 'chat' needs text prompts, not token ids")
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.max_tokens
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.max_tokens
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    async def send(self, index: int, request: BenchRequest, origin: float) -> RequestRecord:
        """The record of one request; never raises for what the server or the network does."""
        assert self.session is not None, "use the client inside 'async with'"
        body = self.payload(request)
        chunk_times: list[float] = []
        usage: dict[str, Any] | None = None
        status: int | None = None
        error, is_done = "", False
        send_time = self.clock() - origin
        try:
            async with self.session.post(self.url, json=body, headers=self.headers) as response:
                status = response.status
                if status != 200:
                    error = _error_message(await response.text())
                else:
                    async for raw in response.content:  # one SSE line at a time
                        now = self.clock() - origin
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event names
                        data = line[len(b"data:"):].strip()
                        if data == b"[DONE]":
                            is_done = True
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = "error event in the stream: " + _error_message(data.decode())
                            break
                        if any(_has_tokens(c) for c in chunk.get("choices") or ()):
                            chunk_times.append(now)
                        usage = chunk.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        end_time = self.clock() - origin
        if not error:
            if not is_done:
                error = "the stream ended without 'data: [DONE]'"
            elif not chunk_times:
                error = "the stream carried no token"
            elif usage is None:
                error = "no usage in the stream: does the server honour stream_options.include_usage?"
            elif not int(usage.get("completion_tokens") or 0) >= 1:
                error = f"usage counts no completion token, yet the stream carried some: {usage}"
        if error:
            return RequestRecord(index, request.max_tokens, send_time, end_time, tuple(chunk_times),
                                 http_status=status, error=error)
        assert usage is not None
        return RequestRecord(
            index, request.max_tokens, send_time, end_time, tuple(chunk_times),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            is_success=True, http_status=status,
        )
