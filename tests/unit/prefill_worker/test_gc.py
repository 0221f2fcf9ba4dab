"""A prefill worker built with freeze_gc moves its startup's objects out of the collector's reach, as a decode
worker does (a Ray actor's process is the worker's alone; engine/process_gc.py)."""

from __future__ import annotations

import asyncio
import gc

from engine.llm import engine_config
from engine.process_gc import GEN0_THRESHOLD
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig


def test_freeze_gc_freezes_the_startup_objects() -> None:
    async def built(**options) -> int:
        worker = PrefillWorker(PrefillWorkerConfig(worker_id="p0", engine=engine_config(device="cpu", num_blocks=32),
                                                   transport="local", **options),
                               transport_options={"hub": LocalHub()})
        num_frozen = gc.get_freeze_count()
        assert await worker.check_integrity() == 0
        await worker.shutdown()
        return num_frozen

    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        assert asyncio.run(built()) == 0 and gc.get_threshold() == threshold
        assert asyncio.run(built(freeze_gc=True)) > 0
        assert gc.get_threshold()[0] == GEN0_THRESHOLD
    finally:
        gc.unfreeze()  # NOTE: what the test process froze is the collector's again, at its thresholds
        gc.set_threshold(*threshold)
