"""A stand-in for loadgen's OpenAIStreamClient (`async with`, `send(index, request, origin)`): every
request streams its max_tokens over 10 ms and succeeds; what was sent, and when, is kept in `sent`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from loadgen.records import RequestRecord


class FakeStreamClient:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, float]] = []  # (the request, time.perf_counter() at its send)

    async def __aenter__(self) -> FakeStreamClient:
        return self

    async def __aexit__(self, *exc: object) -> bool:
        return False

    async def send(self, index: int, request: Any, origin: float) -> RequestRecord:
        self.sent.append((request, time.perf_counter()))
        start = time.perf_counter() - origin
        await asyncio.sleep(0.01)
        n = request.max_tokens
        chunks = tuple(start + 0.01 * (k + 1) / n for k in range(n))
        return RequestRecord(index, n, start, chunks[-1], chunks, prompt_tokens=len(request.prompt),
                             completion_tokens=n, is_success=True, http_status=200)
