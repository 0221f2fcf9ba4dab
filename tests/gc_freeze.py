"""A worker built with freeze_gc moves its startup's objects out of the collector's reach and collects the
youngest generation less often (engine/process_gc.py); built without it, it does neither. Shared by the
decode and prefill workers' tests."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

from engine.process_gc import GEN0_THRESHOLD


def check_freeze_gc(make_worker: Callable[..., Any]) -> None:
    """make_worker(**options): a worker (check_integrity, shutdown) built with those config options."""
    async def built(**options: Any) -> int:
        worker = make_worker(**options)
        num_frozen = gc.get_freeze_count()
        assert await worker.check_integrity() == 0
        await worker.shutdown()
        return num_frozen

    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        assert asyncio.run(built()) == 0 and gc.get_threshold() == threshold
        assert asyncio.run(built(freeze_gc=True)) > 0
        assert gc.get_threshold()[0] == GEN0_THRESHOLD  # the youngest generation collected less often
    finally:
        gc.unfreeze()  # NOTE: what the test process froze is the collector's again, at its thresholds
        gc.set_threshold(*threshold)
