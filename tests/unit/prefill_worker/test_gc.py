"""A prefill worker built with freeze_gc moves its startup's objects out of the collector's reach, as a decode
worker does (a Ray actor's process is the worker's alone; engine/process_gc.py)."""

from __future__ import annotations

from engine.llm import engine_config
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from tests.gc_freeze import check_freeze_gc


def test_freeze_gc_freezes_the_startup_objects() -> None:
    check_freeze_gc(lambda **options: PrefillWorker(
        PrefillWorkerConfig(worker_id="p0", engine=engine_config(device="cpu", num_blocks=32), transport="local",
                            **options),
        transport_options={"hub": LocalHub()}))
