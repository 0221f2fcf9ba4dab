"""Per-request span records: where one request's time went across the router, the prefill
worker, the KV transfer and the decode worker. Kept for the most recent requests (bounded) and
served at GET /v1/requests/{id}/trace.

Times are seconds since the router received the request (one clock: the router's). The prefill
worker's own compute and push durations arrive with its result and are recorded as attributes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestSpan:
    request_id: str
    started_at: float  # the router's clock
    events: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds since started_at)
    attributes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "events": [{"name": n, "t_s": round(t, 6)} for n, t in self.events],
            "attributes": dict(self.attributes),
        }


class SpanRecorder:
    """Spans of the last `max_requests` requests, oldest dropped first."""

    def __init__(self, max_requests: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_requests = max_requests
        self.clock = clock
        self._spans: OrderedDict[str, RequestSpan] = OrderedDict()

    def start(self, request_id: str) -> RequestSpan:
        span = RequestSpan(request_id, self.clock())
        self._spans[request_id] = span
        self._spans.move_to_end(request_id)
        while len(self._spans) > self.max_requests:
            self._spans.popitem(last=False)
        return span

    def event(self, request_id: str, name: str, **attributes: Any) -> None:
        span = self._spans.get(request_id)
        if span is None:
            return
        span.events.append((name, self.clock() - span.started_at))
        span.attributes.update(attributes)

    def find(self, request_id: str) -> list[dict[str, Any]]:
        """The span of `request_id` and of its choices (`{request_id}-{i}`)."""
        prefix = f"{request_id}-"
        return [s.as_dict() for k, s in self._spans.items() if k == request_id or k.startswith(prefix)]
