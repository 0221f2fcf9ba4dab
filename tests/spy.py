"""Spy: a worker as the router sees it (a Ray actor handle, or the worker object in-process) that
records the request ids of the protocol calls it is given (prefill, reserve, prefill_locally, submit), so a
test can tell which worker a request reached and by which path."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from protocol.messages import GenerateRequestMsg, LocalPrefillMsg, PrefillTaskMsg, ReserveMsg
from protocol.clients import invoke


class Spy:
    _REQUEST_ID: ClassVar[dict[str, Callable[[Any], str]]] = {
        "prefill": lambda raw: PrefillTaskMsg.decode(raw).request.request_id,
        "reserve": lambda raw: ReserveMsg.decode(raw).request_id,
        "prefill_locally": lambda raw: LocalPrefillMsg.decode(raw).request.request_id,
        "submit": lambda raw: GenerateRequestMsg.decode(raw).request_id,
    }

    def __init__(self, worker: Any, calls: dict[str, list[str]] | None = None) -> None:
        self.worker = worker
        self.calls: dict[str, list[str]] = calls if calls is not None else defaultdict(list)  # method -> request ids

    def __reduce__(self) -> Any:  # NOTE: a Ray handle passed on (to a prefill worker, as its KV's destination)
        # goes bare
        return self.worker.__reduce__()

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self.worker, name)

        async def call(*args: Any) -> Any:
            if name in self._REQUEST_ID:
                self.calls[name].append(self._REQUEST_ID[name](args[0]))
            return await invoke(method, *args)

        return call
