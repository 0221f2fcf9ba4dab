"""ClusterController: a Ray actor that owns the worker pools, watches their health, replaces dead
workers, and tells routers which workers exist (versioned, so routers notice changes cheaply).

Routers are handed this actor's handle and call `workers()`; they never import cluster/.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

from cluster.autoscaler import Autoscaler, Decision, autoscale_once
from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from cluster.pools import WorkerPool
from cluster.ttft_reports import TtftReports
from protocol.api import WorkerStatsMsg
from protocol.messages import TtftCountsMsg

log = logging.getLogger(__name__)


class ClusterController:
    def __init__(self, config: ClusterConfig, health_interval_s: float = 1.0,
                 autoscale_interval_s: float = 1.0) -> None:
        self.config = config
        self.health_interval_s = health_interval_s
        self.autoscale_interval_s = autoscale_interval_s
        self.autoscaler: Autoscaler | None = None
        if config.autoscaler is not None:
            disaggregated = config.mode == "disaggregated"
            self.autoscaler = Autoscaler(
                config.autoscaler, {"prefill": config.tp_of("prefill"), "decode": config.tp_of("decode")},
                frozenset({"prefill", "decode"}) if disaggregated else frozenset())
        self._autoscaling: asyncio.Task[None] | None = None
        self.deployment = Deployment(config)
        self.version = 0
        self.num_replaced = 0
        self._supervisor: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._watchers: set[asyncio.Task[None]] = set()
        self.ttft_reports = TtftReports()  # the routers' first tokens against the TTFT SLO, for the autoscaler

    async def start(self) -> None:
        await self.deployment.start()
        self.version += 1
        self._ready.set()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        if self.autoscaler is not None:
            self._autoscaling = asyncio.get_running_loop().create_task(self._autoscale())

    async def wait_ready(self) -> int:
        await self._ready.wait()
        return self.version

    async def workers(self, ttft: TtftCountsMsg | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """(version, prefill handles by id, decode handles by id). ttft: the polling router's first tokens
        against the TTFT SLO (router/ttft_window.py), kept for the autoscaler."""
        if ttft is not None:
            self.ttft_reports.add(asyncio.get_running_loop().time(), ttft)
        await self._ready.wait()
        w = self.deployment.workers()
        return self.version, dict(w.prefill), dict(w.decode)

    async def pressure_trace(self) -> list[dict[str, float | int | str | None]]:
        """The autoscaler's readings, oldest first (Autoscaler.trace), each at its wall-clock time (`wall_s`,
        time.time()'s); an infinite pressure as "inf" (JSON has no infinity; None means not measured):
        `pdserve status --trace` writes them as JSON."""
        if self.autoscaler is None:
            return []
        offset = time.time() - asyncio.get_running_loop().time()
        return [{"wall_s": round(s.at_s + offset, 3),
                 **{k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
                    for k, v in s._asdict().items() if k != "at_s"}} for s in self.autoscaler.trace]

    async def first_tokens(self) -> tuple[int, int] | None:
        """The routers' first tokens over their last window and how many came later than the TTFT SLO
        (`pdserve status`); None: no router reported (no TTFT SLO)."""
        counts = self.ttft_reports.counts(asyncio.get_running_loop().time())
        return None if counts is None else (counts.num_first_tokens, counts.num_over_slo)

    async def _supervise(self) -> None:
        """Every interval: dead serving workers leave the routers' set at once (version bump),
        and each replacement joins it once healthy (another bump); starting ones are watched by
        their own task, so one slow start never delays noticing the next death."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for pool in self.deployment.pools:
                for worker_id in await pool.find_dead():
                    new_id = pool.replace(worker_id)
                    self.num_replaced += 1
                    await self._publish()
                    log.warning("worker %s is dead; replacing it with %s", worker_id, new_id)
                    task = asyncio.get_running_loop().create_task(self._publish_when_ready(pool, new_id))
                    self._watchers.add(task)
                    task.add_done_callback(self._watchers.discard)

    async def _autoscale(self) -> None:
        """Every interval, one autoscaler round (cluster/autoscaler.py) over the workers' stats."""
        assert self.autoscaler is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.autoscale_interval_s)
            try:
                stats = [s for s in await self.stats() if isinstance(s, WorkerStatsMsg)]
                pools = {"prefill" if p is self.deployment.prefill else "decode": p for p in self.deployment.pools}
                sizes = {name: p.num_workers for name, p in pools.items()}
                releasable = frozenset(name for name, p in pools.items() if p.newest_is_releasable())
                now = loop.time()
                decision = await autoscale_once(self.autoscaler, now, sizes, stats, self._apply, releasable,
                                                self.ttft_reports.counts(now))
                if decision is not None:
                    log.warning("autoscaler: %s -> %d workers (%s)", decision.pool, decision.num_workers, decision.why)
            except Exception as err:  # noqa: BLE001 - the next round tries again
                log.warning("autoscaler round failed: %s", err)

    async def _publish(self, router_refresh_s: float = 0.0) -> None:
        """The routers' view of the workers changed: the decode workers are told whether they compute every
        prompt before the version the routers follow moves, then (router_refresh_s) every router has polled it."""
        await self._tell_decode_workers()
        self.version += 1
        if router_refresh_s > 0:
            await asyncio.sleep(2 * router_refresh_s)

    async def _tell_decode_workers(self) -> None:
        """Whether the decode workers compute every prompt (DecodeWorker.computes_every_prompt): while the
        routers see no prefill worker (none left, or the last one draining) they send them whole requests."""
        prefill, decode = self.deployment.prefill, self.deployment.decode
        if prefill is None or decode is None:
            return
        every = not prefill.router_handles()
        for worker_id, handle in list(decode.handles.items()):
            try:
                await asyncio.wait_for(handle.computes_every_prompt.remote(every), 5.0)
            except Exception as err:  # noqa: BLE001 - a dead worker is replaced (and told) by the supervisor
                log.warning("telling %s whether it computes every prompt failed: %s", worker_id, err)

    async def _apply(self, decision: Decision) -> None:
        if decision.flip_to is None:
            await self.resize(decision.pool, decision.num_workers)
            return
        source = self.deployment.prefill if decision.pool == "prefill" else self.deployment.decode
        target = self.deployment.decode if decision.pool == "prefill" else self.deployment.prefill
        assert source is not None and target is not None
        if source.ranks != target.ranks:  # NOTE: workers of other sizes cannot change role in place
            await self.resize(decision.pool, decision.num_workers)
            await self.resize(decision.flip_to, target.num_workers + 1)
            return
        await self.flip(source.serving_ids()[-1], decision.flip_to)  # the newest

    async def decisions(self, held_back: bool = False) -> list[tuple[float, str, int, str]]:
        """The autoscaler's decisions, oldest first: (seconds ago, pool, its new size, why); with held_back,
        the moves it did not make instead (their why says why not)."""
        if self.autoscaler is None:
            return []
        now = asyncio.get_running_loop().time()
        kept = self.autoscaler.held_back if held_back else self.autoscaler.decisions
        return [(now - d.at_s, d.pool, d.num_workers, d.why) for d in kept]

    async def _publish_when_ready(self, pool: WorkerPool, worker_id: str, max_starts: int = 3) -> None:
        for start in range(max_starts):
            if await pool.await_replacement(worker_id):
                await self._publish()  # NOTE: a new decode worker starts with the budget: told before routers see it
                log.warning("replacement %s is serving", worker_id)
                return
            if start + 1 < max_starts:
                log.warning("replacement %s did not become healthy; starting another", worker_id)
                worker_id = pool.replace(worker_id)
        log.error("no healthy replacement after %d starts; the pool runs one worker short", max_starts)

    async def resize(self, kind: str, num_workers: int, router_refresh_s: float = 1.0) -> list[str]:
        """Grows or shrinks the `kind` pool ("prefill" or "decode") while serving; returns the ids
        added or retired. Routers follow the version within `router_refresh_s`; a retiring decode
        worker is drained first, so a router that has not refreshed yet still leases elsewhere."""
        pool = {"prefill": self.deployment.prefill, "decode": self.deployment.decode}.get(kind)
        if pool is None:
            raise ValueError(f"kind must be 'prefill' or 'decode' (with a prefill pool), got {kind!r}")

        return await pool.resize(num_workers, functools.partial(self._publish, router_refresh_s))

    async def flip(self, worker_id: str, to_kind: str, router_refresh_s: float = 1.0) -> None:
        """Moves a serving worker to the other pool in place ("prefill" -> "decode" or back): drained,
        it changes role keeping its engine (cluster/flex_worker.py), and rejoins; routers follow the
        version within `router_refresh_s`."""
        pools = {"prefill": self.deployment.prefill, "decode": self.deployment.decode}
        target, source = pools.get(to_kind), pools.get("decode" if to_kind == "prefill" else "prefill")
        if target is None or source is None or self.config.mode != "disaggregated":
            raise ValueError(f"to_kind must be 'prefill' or 'decode' in disaggregated mode, got {to_kind!r}")

        await source.hand_over(worker_id, target, self.deployment.role_config(to_kind, worker_id),
                               functools.partial(self._publish, router_refresh_s))

    async def held_blocks(self) -> dict[str, int]:
        return await self.deployment.held_blocks()

    async def stats(self) -> list[WorkerStatsMsg | str]:
        """Every worker's stats, or why it did not answer."""
        out: list[WorkerStatsMsg | str] = []
        for pool in self.deployment.pools:
            for handle in pool.handles.values():
                try:
                    out.append(await asyncio.wait_for(handle.stats.remote(), 5.0))
                except Exception as err:  # noqa: BLE001 - shown as unreachable
                    out.append(str(err))
        return out

    async def shutdown(self) -> None:
        for task in (self._supervisor, self._autoscaling):
            if task is not None:
                task.cancel()
        self.deployment.shutdown()
