"""WorkerPool's placement bookkeeping across role changes (no Ray cluster: fake worker handles, fake
placement groups): a worker handed to the other pool keeps its bundle, and when it ends there the bundle
goes back to the pool that reserved its group, which alone can spawn on it or release it. Before, a
decode pool that retired a worker it had been handed tried to release the prefill pool's group as a
grown group of its own (ValueError: list.remove(x): x not in list, seen on 4x H200: the autoscaler's
round failed and the GPU stayed reserved by nobody who could use it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import cluster.pools as pools
from cluster.pools import WorkerPool


class Remote:
    def __init__(self, result: Any = None) -> None:
        self.result = result

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.result
        return call()


class FakeWorker:
    """What a pool calls on a worker while draining, flipping and retiring it: all idle, all fine."""

    def __init__(self) -> None:
        idle = SimpleNamespace(num_waiting=0, num_running=0, num_leases=0, num_undelivered=0)
        self.drain, self.stats, self.check_integrity = Remote(), Remote(idle), Remote(0)
        self.flip, self.shutdown = Remote(), Remote()


def pool(kind: str, group: str, worker_ids: list[str]) -> WorkerPool:
    p = WorkerPool(kind, object, lambda worker_id: None, len(worker_ids), num_gpus=1.0)
    p._pg = group  # type: ignore[assignment]
    for i, worker_id in enumerate(worker_ids):
        p.handles[worker_id] = FakeWorker()
        p._bundle_of[worker_id] = (group, i)  # type: ignore[assignment]
    return p


def test_a_bundle_goes_back_to_the_pool_that_reserved_it(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[str] = []
    monkeypatch.setattr(pools, "remove_placement_group", released.append)
    monkeypatch.setattr(pools.ray, "kill", lambda handle, no_restart=True: None)
    prefill, decode = pool("prefill", "P", ["prefill-0"]), pool("decode", "D", ["decode-0"])
    # decode-1 on a one-bundle group the decode pool grew
    decode.handles["decode-1"], decode._bundle_of["decode-1"] = FakeWorker(), ("G", 0)  # type: ignore[assignment]
    decode._grown_pgs.append("G")  # type: ignore[arg-type]
    decode.num_workers = 2

    async def run() -> None:
        # 1P2D -> 0P3D, then the decode pool shrinks by its newest worker: the one it was handed
        await prefill.hand_over("prefill-0", decode, None, drain_timeout_s=5, settle_s=0)
        assert decode.serving_ids() == ["decode-0", "decode-1", "prefill-0"]
        assert await decode.resize(2, drain_timeout_s=5, settle_s=0) == ["prefill-0"]
        # decode-1 goes to the prefill pool (which is empty) and ends there: its grown group is released
        await decode.hand_over("decode-1", prefill, None, drain_timeout_s=5, settle_s=0)
        prefill._retire("decode-1")

    asyncio.run(run())
    assert prefill._free_bundles == [("P", 0)]  # back where it was reserved: the prefill pool can spawn on it
    assert decode._free_bundles == [] and decode._grown_pgs == [] and released == ["G"]
    assert not prefill._lent_from and not decode._lent_from


def test_a_worker_handed_back_holds_its_own_pools_bundle_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools.ray, "kill", lambda handle, no_restart=True: None)
    prefill, decode = pool("prefill", "P", ["prefill-0"]), pool("decode", "D", ["decode-0"])

    async def run() -> None:
        await prefill.hand_over("prefill-0", decode, None, drain_timeout_s=5, settle_s=0)
        await decode.hand_over("prefill-0", prefill, None, drain_timeout_s=5, settle_s=0)
        assert not prefill._lent_from and not decode._lent_from
        prefill._retire("prefill-0")

    asyncio.run(run())
    assert prefill._free_bundles == [("P", 0)] and decode._free_bundles == []


def test_only_a_worker_on_a_grown_group_gives_a_gpu_back_when_retired() -> None:
    prefill, decode = pool("prefill", "P", ["prefill-0"]), pool("decode", "D", ["decode-0", "decode-1"])
    assert not decode.newest_is_releasable()  # decode-1 sits on the start group: it stays reserved
    decode.handles["decode-2"], decode._bundle_of["decode-2"] = FakeWorker(), ("G", 0)  # type: ignore[assignment]
    decode._grown_pgs.append("G")  # type: ignore[arg-type]
    assert decode.newest_is_releasable()
    asyncio.run(prefill.hand_over("prefill-0", decode, None, drain_timeout_s=5, settle_s=0))
    assert not decode.newest_is_releasable()  # the prefill pool's start group: back there, still reserved
    cpu = WorkerPool("decode", object, lambda worker_id: None, 1, num_gpus=0.0)
    cpu.handles["decode-0"] = FakeWorker()
    assert cpu.newest_is_releasable()  # no GPU held: retiring it frees what it uses


class BusyThenIdle:
    """stats: busy (one waiting prompt, 3 blocks held) for `busy_calls` calls, then idle."""

    def __init__(self, busy_calls: int) -> None:
        self.calls = 0
        self.busy_calls = busy_calls
        self.stats, self.check_integrity = self, Remote(None)

    def remote(self, *args: Any) -> Any:
        self.calls += 1
        busy = self.calls <= self.busy_calls
        self.check_integrity.result = 3 if busy else 0

        async def call() -> Any:
            return SimpleNamespace(num_waiting=int(busy), num_running=0, num_leases=0, num_undelivered=0)
        return call()


def test_a_worker_draining_long_is_logged_with_what_keeps_it_busy(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The autoscaler drains silently otherwise: on 4x H200 a flipping prefill worker sat out of both
    pools for a minute and nothing said why."""
    monkeypatch.setattr(pools, "DRAIN_REPORT_S", 0.0)
    p = pool("prefill", "pg0", ["prefill-0"])
    p.handles["prefill-0"] = BusyThenIdle(busy_calls=3)
    with caplog.at_level("WARNING", logger="cluster.pools"):
        assert asyncio.run(p._wait_idle("prefill-0", timeout_s=10.0, poll_interval_s=0.001))
    reports = [r.getMessage() for r in caplog.records if "still draining" in r.getMessage()]
    assert reports and "prefill-0 still draining after" in reports[0]
    assert "1 waiting, 0 running, 0 leases, 3 blocks held, 0 undelivered" in reports[0]
