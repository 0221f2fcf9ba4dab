"""WorkerSetFollower: keeps a Dispatcher's worker set in step with a cluster controller's
versioned `workers()` (version, prefill handles, decode handles), the way every router replica
follows worker replacements and resizes. Knows nothing of how the controller is reached."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from router.dispatch import Dispatcher, Workers

log = logging.getLogger(__name__)

FetchWorkers = Callable[[], Awaitable[tuple[int, dict[str, Any], dict[str, Any]]]]


class WorkerSetFollower:
    def __init__(self, dispatcher: Dispatcher, fetch: FetchWorkers, interval_s: float = 1.0,
                 wrap: Callable[[Workers], Workers] | None = None) -> None:
        self.dispatcher = dispatcher
        self.fetch = fetch
        self.wrap = wrap  # applied to each new set before the Dispatcher takes it (the request channels)
        self.interval_s = interval_s
        self.version = -1
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> bool:
        """Takes the controller's set if its version changed; True when it did."""
        version, prefill, decode = await self.fetch()
        if version == self.version:
            return False
        self.version = version
        workers = Workers.of(prefill=prefill, decode=decode)
        self.dispatcher.set_workers(self.wrap(workers) if self.wrap is not None else workers)
        return True

    async def start(self) -> None:
        """One refresh now (errors propagate), then one every interval in the background."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception as err:  # noqa: BLE001 - the controller restarts; keep the last set
                log.warning("cannot reach the cluster controller: %s", err)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
