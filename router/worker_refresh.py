"""What the router keeps of every worker and refreshes in the background (their loads, their prefix
caches): one call a worker every `interval_s`, all at once; a failed call keeps what it had."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_TIMEOUT_S = 2.0


class WorkerRefresh:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.worker_ids: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def track(self, worker_ids: Sequence[str]) -> None:
        """Refreshes these workers from now on (forgetting the others); starts the background task."""
        if list(worker_ids) != self.worker_ids:
            self.worker_ids = list(worker_ids)
            self._forget_all_but(set(worker_ids))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def refresh(self) -> None:
        raise NotImplementedError

    def _forget_all_but(self, kept: set[str]) -> None:
        """Drops what it holds of workers not in `kept`."""
        raise NotImplementedError

    async def _ask_each(self, call: Callable[[str], Awaitable[T]]) -> list[tuple[str, T | BaseException]]:
        """`call(worker_id)` for every tracked worker at once: (worker, its answer or what it raised)."""
        ids = list(self.worker_ids)
        answers = await asyncio.gather(*(asyncio.wait_for(call(i), CALL_TIMEOUT_S) for i in ids),
                                       return_exceptions=True)
        return list(zip(ids, answers))

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as err:  # noqa: BLE001 - a failed refresh keeps what it had
                log.debug("%s refresh failed: %s", type(self).__name__, err)
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
