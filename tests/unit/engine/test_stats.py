"""EngineStats.load(): every field a worker reports, each one a WorkerStatsMsg field (a figure added to the
engine's stats and not to the message would fail every worker's stats call)."""

from __future__ import annotations

import dataclasses

from engine.stats import ENGINE_ONLY, EngineStats
from protocol.api import WorkerStatsMsg


def test_load_is_every_field_but_the_engine_only_ones_and_the_message_takes_them() -> None:
    stats = EngineStats(num_waiting=1, num_running=2, num_blocks=10, num_free_blocks=4, num_cached_blocks=3,
                        num_preemptions=5, num_spec_verifications=7, gc_seconds=0.5, weights="fp8")
    load = stats.load()
    assert set(load) == {f.name for f in dataclasses.fields(EngineStats)} - ENGINE_ONLY
    assert load["num_cached_blocks"] == 3 and load["weights"] == "fp8" and load["gc_seconds"] == 0.5
    msg = WorkerStatsMsg(worker_id="d0", role="decode", pid=1, is_healthy=True, **load)
    assert (msg.num_preemptions, msg.num_cached_blocks, msg.gc_seconds) == (5, 3, 0.5)
