"""Worker pools: Ray actors of one worker kind, their placement, health, replacement and resizing.

A pool names its workers `<kind>-<n>`; a replaced or added worker gets a new name (n only grows),
so a dead or retired worker's id is never reused and stale leases or pairs cannot be confused
with the new one.

Placement: every worker asks for the pool's `resources` (Ray custom resources such as
`{"pdserve_decode": 1}`, from ClusterConfig), so it lands only on nodes that offer them. With
GPUs each worker has a placement-group bundle `{"GPU": num_gpus, **resources}`, times `ranks` for
a tensor-parallel worker: one bundle holds all its ranks, so they share a node (the worker actor
is rank 0 and starts the others in that bundle: cluster/ranks.py).

Worker states, as routers see them (`router_handles`):

    starting --healthy--> serving --resize down--> retiring --idle--> (retired: killed)
       (not shown)          (shown)                (decode: shown as a RetiringDecodeClient,
                                                    which takes no new lease; prefill: not shown)
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.ranks import RayRanks
from kvtransfer import NCCL_WORKER_ENV
from protocol.clients import DecodeClient, PrefillClient, RetiringDecodeClient, WorkerClient

log = logging.getLogger(__name__)

Bundle = tuple[PlacementGroup, int]  # (group, bundle index)
Publish = Callable[[], Awaitable[None] | None]


DRAIN_REPORT_S = 10.0
"""A worker draining this long is logged with what keeps it busy, then every three times as long."""


class WorkerPool:
    def __init__(
        self,
        kind: str,
        worker_cls: type,
        make_config: Callable[[str], Any],
        num_workers: int,
        num_gpus: float,
        env: dict[str, str] | None = None,
        resources: dict[str, float] | None = None,
        ranks: int = 1,
    ) -> None:
        """ranks: tensor-parallel ranks per worker, each with num_gpus and resources of its own."""
        self.kind = kind
        self.ranks = ranks
        self.worker_cls = worker_cls
        self.make_config = make_config
        self.num_workers = num_workers  # serving workers wanted
        self.num_gpus = num_gpus
        self.resources = dict(resources or {})  # custom resources each worker asks for (placement)
        self.env = {**(NCCL_WORKER_ENV if num_gpus > 0 else {}), **(env or {})}
        self.handles: dict[str, Any] = {}  # every live worker: starting, serving or retiring
        self.starting: set[str] = set()  # spawned by `resize`, not yet healthy: routers do not see them
        self.retiring: set[str] = set()  # draining before they are killed
        self._names = itertools.count()
        self._pg: PlacementGroup | None = None  # the group `start` reserves, one bundle per worker
        self._grown_pgs: list[PlacementGroup] = []  # one-bundle groups `resize` added
        self._free_bundles: list[Bundle] = []  # of this pool's own groups only
        self._bundle_of: dict[str, Bundle] = {}
        # a worker that came from another pool (hand_over) keeps that pool's bundle: it goes back there when
        # the worker ends, as only the pool that reserved a group can spawn on it or release it
        self._lent_from: dict[str, WorkerPool] = {}
        self._resizing = asyncio.Lock()  # one resize at a time

    @property
    def _bundle(self) -> dict[str, float]:
        return {"GPU": self.num_gpus * self.ranks, **{k: v * self.ranks for k, v in self.resources.items()}}

    def start(self) -> None:
        if self.num_gpus > 0:
            # One bundle per worker, packed: prefill and decode pools each get their own group.
            self._pg = placement_group([self._bundle] * self.num_workers, strategy="PACK")
            ray.get(self._pg.ready())
            self._free_bundles = [(self._pg, i) for i in range(self.num_workers)]
        for _ in range(self.num_workers):
            self._spawn()

    def _spawn(self) -> str:
        worker_id = f"{self.kind}-{next(self._names)}"
        options: dict[str, Any] = dict(
            name=f"pdserve-{worker_id}",
            num_cpus=0,
            num_gpus=self.num_gpus,
            max_concurrency=1000,
            runtime_env={"env_vars": self.env} if self.env else None,
        )
        if self.resources:
            options["resources"] = self.resources  # inside a bundle: taken from the bundle, which holds them
        if self.num_gpus > 0:
            group, index = self._bundle_of[worker_id] = self._free_bundles.pop(0)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, index)
        kwargs: dict[str, Any] = {}
        if self.ranks > 1:
            kwargs["start_ranks"] = RayRanks(self._bundle_of.get(worker_id), self.num_gpus, self.resources, self.env)
        actor_cls = ray.remote(self.worker_cls)
        self.handles[worker_id] = actor_cls.options(**options).remote(self.make_config(worker_id), **kwargs)
        return worker_id

    def newest_is_releasable(self) -> bool:
        """Whether retiring the newest serving worker (the one a shrink retires) gives back what it holds: no
        GPU, or a bundle of a group this pool grew (released with it). A bundle of a start group stays
        reserved, in whichever pool it goes back to."""
        serving = self.serving_ids()
        if not serving or self.num_gpus <= 0:
            return bool(serving)
        newest = serving[-1]
        bundle, owner = self._bundle_of.get(newest), self._lent_from.get(newest, self)
        return bundle is not None and any(bundle[0] is g for g in owner._grown_pgs)

    def serving_ids(self) -> list[str]:
        """Workers routers use for new work (neither starting nor retiring), oldest first."""
        return [i for i in self.handles if i not in self.starting and i not in self.retiring]

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        await asyncio.wait_for(asyncio.gather(*(h.health.remote() for h in self.handles.values())), timeout_s)

    def router_handles(self) -> dict[str, WorkerClient]:
        """The clients of the workers routers may use, by id: serving ones, and retiring decode
        workers (they still stream tokens) as RetiringDecodeClients until they are idle."""
        is_prefill = self.kind == "prefill"
        out: dict[str, WorkerClient] = {}
        for worker_id, handle in self.handles.items():
            if worker_id in self.starting or (worker_id in self.retiring and is_prefill):
                continue
            if worker_id in self.retiring:
                out[worker_id] = RetiringDecodeClient(worker_id, handle)
            else:
                out[worker_id] = PrefillClient(worker_id, handle) if is_prefill else DecodeClient(worker_id, handle)
        return out

    async def find_dead(self, timeout_s: float = 5.0) -> list[str]:
        """Serving workers that do not answer a health check (Ray reports them dead, or they hang).
        Starting and retiring workers are `resize`'s to watch, not the supervisor's to replace."""
        ids = self.serving_ids()
        results = await asyncio.gather(
            *(asyncio.wait_for(self.handles[i].health.remote(), timeout_s) for i in ids), return_exceptions=True
        )
        return [i for i, ok in zip(ids, results) if ok is not True and i in self.handles and i not in self.retiring]

    def replace(self, worker_id: str) -> str:
        """Drops a dead worker and starts a new one in its place (its bundle, a new id). The new
        one is `starting`, hidden from routers, until `await_replacement` finds it healthy."""
        self._retire(worker_id, self.handles.pop(worker_id))
        new_id = self._spawn()
        self.starting.add(new_id)
        return new_id

    async def await_replacement(self, worker_id: str, timeout_s: float = 180.0) -> bool:
        """Waits until a replacement answers its health check, then shows it to routers; False
        (it stays hidden, and is replaced again if it died) when it does not in time."""
        handle = self.handles.get(worker_id)
        if handle is None:
            return False
        try:
            is_healthy = await asyncio.wait_for(handle.health.remote(), timeout_s)
        except Exception:  # noqa: BLE001 - a timeout, or a worker that died starting
            is_healthy = False
        if is_healthy is True:
            self.starting.discard(worker_id)
            return True
        return False

    # ---- resizing while serving
    async def resize(
        self,
        num_workers: int,
        publish: Publish | None = None,
        *,
        ready_timeout_s: float = 180.0,
        drain_timeout_s: float = 300.0,
        poll_interval_s: float = 0.1,
        settle_s: float = 0.5,
    ) -> list[str]:
        """Grows or shrinks the pool to `num_workers` serving workers while it serves; returns the
        ids added or retired. `publish` is called (and awaited) after each change of what
        `router_handles` shows; it must return once every router has taken the new set (the
        Dispatcher's `set_workers` does, at once).

        Grow: spawn, wait until healthy (or retire them and raise TimeoutError), then publish.
        Shrink, newest workers first. NOTE: the order is what makes it lossless:
          1. mark them retiring and publish: routers lease on them no more (a decode worker is
             shown as a RetiringDecodeClient, so its streams keep being polled; a prefill worker leaves
             the set: its prefill calls under way keep their channel until answered, router/channels.py);
          2. wait until each is idle twice in a row (nothing waiting, running or leased, no block
             held), then `settle_s` more for its last token batch to reach the router;
          3. drop them from the pool and publish: routers forget them, with nothing left to fail;
          4. shut their engines down, kill the actors and free their bundles.
        A worker still busy after `drain_timeout_s` is retired anyway (its requests then end with
        the router's "left the cluster" error) and a warning is logged.
        """
        least = 0 if self.kind == "prefill" else 1  # NOTE: with no prefill worker, decode workers compute every prompt
        if num_workers < least:
            raise ValueError(f"num_workers is {num_workers}; a {self.kind} pool needs at least {least} worker(s)")
        async with self._resizing:
            serving = self.serving_ids()
            if num_workers > len(serving):
                return await self._grow(num_workers - len(serving), publish, ready_timeout_s)
            if num_workers < len(serving):
                if self.kind == "colocated":
                    raise NotImplementedError(
                        "shrinking a colocated pool cannot drain it: a colocated worker has no way to refuse "
                        "the router's submit; resize the decode pool of a disaggregated deployment instead"
                    )
                victims = serving[num_workers:]  # insertion order is spawn order: the newest last
                return await self._shrink(victims, publish, drain_timeout_s, poll_interval_s, settle_s)
            return []

    async def _grow(self, count: int, publish: Publish | None, timeout_s: float) -> list[str]:
        new_ids: list[str] = []
        try:
            for _ in range(count):
                if self.num_gpus > 0 and not self._free_bundles:
                    group = placement_group([self._bundle], strategy="PACK")
                    self._grown_pgs.append(group)
                    self._free_bundles.append((group, 0))
                    await asyncio.wait_for(group.ready(), timeout_s)
                worker_id = self._spawn()
                self.starting.add(worker_id)
                new_ids.append(worker_id)
            await asyncio.wait_for(asyncio.gather(*(self.handles[i].health.remote() for i in new_ids)), timeout_s)
        except Exception as err:  # noqa: BLE001 - a timeout, or a worker that died starting
            for worker_id in new_ids:
                self._retire(worker_id)
            self._release_grown_groups()
            raise TimeoutError(
                f"{self.kind} pool: {count} new worker(s) did not become healthy within {timeout_s} s ({err!r}); "
                f"does a node offer {self._bundle if self.num_gpus > 0 else self.resources or 'room'}?"
            ) from err
        self.starting.difference_update(new_ids)
        self.num_workers += count
        await _call(publish)
        log.info("%s pool grew by %s", self.kind, new_ids)
        return new_ids

    async def _shrink(
        self, victims: list[str], publish: Publish | None, drain_timeout_s: float, poll_interval_s: float,
        settle_s: float,
    ) -> list[str]:
        handles = await self._drain_out(victims, publish, drain_timeout_s, poll_interval_s, settle_s)
        for worker_id, handle in handles.items():
            try:
                await asyncio.wait_for(handle.shutdown.remote(), 10.0)
            except Exception as err:  # noqa: BLE001 - killed below either way
                log.warning("shutting down %s failed: %s", worker_id, err)
            self._retire(worker_id, handle)
        self._release_grown_groups()
        log.info("%s pool retired %s", self.kind, victims)
        return victims

    async def _drain_out(
        self, victims: list[str], publish: Publish | None, drain_timeout_s: float, poll_interval_s: float,
        settle_s: float,
    ) -> dict[str, Any]:
        """Steps 1-3 of `resize`'s shrink: the victims leave the routers' view with nothing left on
        them; returns their handles, no longer in the pool."""
        self.retiring.update(victims)
        self.num_workers -= len(victims)
        for worker_id in victims:  # NOTE: first, so that even a router with a stale set leases elsewhere
            if self.kind != "prefill":
                try:
                    await asyncio.wait_for(self.handles[worker_id].drain.remote(), 10.0)
                except Exception as err:  # noqa: BLE001 - a dead worker needs no draining
                    log.warning("draining %s failed: %s", worker_id, err)
        await _call(publish)
        drained = await asyncio.gather(
            *(self._wait_idle(i, drain_timeout_s, poll_interval_s) for i in victims)
        )
        if any(drained):
            await asyncio.sleep(settle_s)  # NOTE: the last token batch may still be on its way to a router
        handles = {i: self.handles.pop(i) for i in victims}
        self.retiring.difference_update(victims)
        await _call(publish)
        return handles

    async def hand_over(
        self, worker_id: str, to: WorkerPool, config: Any, publish: Publish | None = None, *,
        drain_timeout_s: float = 300.0, poll_interval_s: float = 0.1, settle_s: float = 0.5,
    ) -> None:
        """Moves a serving worker to pool `to` in place (cluster/flex_worker.py): it is drained as
        `resize` drains a worker it retires (no new work, idle twice in a row, nothing held), then
        changes role under `config` keeping its engine, and joins `to`; `publish` runs after each
        change of the routers' view. Both pools' workers must have the same GPUs (ranks). The prefill
        pool may give its last worker (the decode workers then compute every prompt); the decode pool
        may not."""
        if to.ranks != self.ranks or to.num_gpus != self.num_gpus:
            raise ValueError(f"a {self.kind} worker of {self.ranks} rank(s) x {self.num_gpus} GPU cannot become a "
                             f"{to.kind} worker of {to.ranks} x {to.num_gpus}: the pools' worker sizes differ")
        async with self._resizing, to._resizing:
            serving = self.serving_ids()
            if worker_id not in serving:
                raise ValueError(f"{worker_id} is not a serving worker of the {self.kind} pool")
            if len(serving) <= 1 and self.kind != "prefill":
                raise ValueError(f"{worker_id} is the {self.kind} pool's last serving worker")
            drained = await self._drain_out([worker_id], publish, drain_timeout_s, poll_interval_s, settle_s)
            handle = drained[worker_id]
            try:
                await handle.flip.remote(config)  # NOTE: refuses a worker that still holds anything
            except Exception:
                self._retire(worker_id, handle)  # neither pool's: it goes, its GPUs back to this pool
                raise
            if worker_id in self._bundle_of:
                owner = self._lent_from.pop(worker_id, self)
                to._bundle_of[worker_id] = self._bundle_of.pop(worker_id)
                if owner is not to:
                    to._lent_from[worker_id] = owner
            to.handles[worker_id] = handle
            to.num_workers += 1
            await _call(publish)
        log.info("%s moved from the %s pool to the %s pool", worker_id, self.kind, to.kind)

    async def _wait_idle(self, worker_id: str, timeout_s: float, poll_interval_s: float) -> bool:
        """True once the worker was idle on two checks in a row (the second one catches a request
        between two states, e.g. a lease that just became a running sequence); False when it died
        or stayed busy past `timeout_s`."""
        handle = self.handles[worker_id]
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline, next_report = started + timeout_s, started + DRAIN_REPORT_S
        num_idle = 0
        while num_idle < 2:
            if loop.time() > deadline:
                log.warning("%s still busy after %.0f s of draining; retiring it anyway", worker_id, timeout_s)
                return False
            try:
                stats = await asyncio.wait_for(handle.stats.remote(), 5.0)
                num_held = await asyncio.wait_for(handle.check_integrity.remote(), 5.0)
            except Exception as err:  # noqa: BLE001 - dead: its requests failed through the router
                log.warning("%s failed while draining: %s", worker_id, err)
                return False
            is_idle = (
                stats.num_waiting == 0 and stats.num_running == 0
                and stats.num_leases == 0 and num_held == 0 and stats.num_undelivered == 0
            )
            num_idle = num_idle + 1 if is_idle else 0
            if not is_idle and loop.time() > next_report:  # NOTE: what keeps it busy, for whoever reads the log
                next_report = loop.time() + 3 * DRAIN_REPORT_S
                log.warning("%s still draining after %.0f s: %d waiting, %d running, %d leases, %d blocks held, "
                            "%d undelivered", worker_id, loop.time() - started, stats.num_waiting, stats.num_running,
                            stats.num_leases, num_held, stats.num_undelivered)
            if num_idle < 2:
                await asyncio.sleep(poll_interval_s)
        return True

    def _retire(self, worker_id: str, handle: Any = None) -> None:
        """Kills a worker that left (or never joined) the routers' set and frees its bundle."""
        handle = handle if handle is not None else self.handles.pop(worker_id, None)
        self.starting.discard(worker_id)
        self.retiring.discard(worker_id)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if worker_id in self._bundle_of:
            owner = self._lent_from.pop(worker_id, self)
            owner._free_bundles.append(self._bundle_of.pop(worker_id))
            if owner is not self:
                owner._release_grown_groups()

    def _release_grown_groups(self) -> None:
        """Gives back the one-bundle groups `resize` added once their worker is gone (the group of
        `start` stays reserved: a placement group cannot shrink)."""
        for group in [g for g in self._grown_pgs if any(b[0] is g for b in self._free_bundles)]:
            self._free_bundles = [b for b in self._free_bundles if b[0] is not group]
            self._grown_pgs.remove(group)
            remove_placement_group(group)

    def shutdown(self) -> None:
        for handle in self.handles.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.handles.clear()
        self.starting.clear()
        self.retiring.clear()
        for group in [self._pg, *self._grown_pgs]:
            if group is not None:
                remove_placement_group(group)
        self._pg = None
        self._grown_pgs.clear()
        self._free_bundles.clear()
        self._bundle_of.clear()
        self._lent_from.clear()


async def _call(publish: Publish | None) -> None:
    if publish is not None:
        result = publish()
        if inspect.isawaitable(result):
            await result
