"""The chaos suite's cluster and measurements: a ClusterController in this process (it replaces
dead workers) whose workers run the fault transport over gloo, one Dispatcher following its worker
set the way a router replica does, 32 streaming requests whose tokens are recorded as they come,
probes that time how soon new requests are served after a fault, and the drain check (no block held
on any worker)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from cluster.controller import ClusterController
from cluster.deployment import Deployment
from decode_worker import DecodeWorkerConfig
from engine import SamplingParams
from prefill_worker import PrefillWorkerConfig
from router.follow import WorkerSetFollower
from router import Dispatcher, NoCapacityError, RequestFailedError, Workers
from router.dispatch import DispatcherConfig

PAIR_TIMEOUT_S = 10.0


class FaultDeployment(Deployment):
    """A Deployment whose workers run transport='fault' (wrapping gloo), so faults can be armed."""

    def _prefill_config(self, worker_id: str) -> PrefillWorkerConfig:
        return super()._prefill_config(worker_id).model_copy(
            update={"transport": "fault", "pair_timeout_s": PAIR_TIMEOUT_S}
        )

    def _decode_config(self, worker_id: str) -> DecodeWorkerConfig:
        return super()._decode_config(worker_id).model_copy(
            update={"transport": "fault", "pair_timeout_s": PAIR_TIMEOUT_S}
        )


class FaultController(ClusterController):
    def __init__(self, config: ClusterConfig, health_interval_s: float) -> None:
        super().__init__(config, health_interval_s)
        self.deployment = FaultDeployment(config)  # NOTE: before start(): nothing was spawned yet


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.time() of each output with tokens
    error: BaseException | None = None
    finished_at: float = 0.0  # time.time()


class Chaos:
    def __init__(self, config: ClusterConfig, dispatch: DispatcherConfig) -> None:
        self.controller = FaultController(config, health_interval_s=0.5)
        self.dispatch_config = dispatch
        self.dispatcher: Dispatcher | None = None
        self.follower: WorkerSetFollower | None = None
        self._ids = itertools.count()

    # ---- life cycle
    async def start(self, timeout_s: float = 120.0) -> None:
        await asyncio.wait_for(self.controller.start(), timeout_s)
        self.dispatcher = Dispatcher("router-0", Workers({}, {}), poll_timeout_s=0.5, config=self.dispatch_config)
        # Follows the controller the way a Serve router replica does, only more often.
        self.follower = WorkerSetFollower(self.dispatcher, self.controller.workers, interval_s=0.1)
        await self.follower.start()

    async def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await self.controller.shutdown()

    async def refresh(self) -> None:
        assert self.follower is not None
        await self.follower.refresh()

    @property
    def pools(self) -> dict[str, Any]:
        deployment = self.controller.deployment
        return {"prefill": deployment.prefill, "decode": deployment.decode}

    def handles(self, kind: str) -> dict[str, Any]:
        return dict(self.pools[kind].handles)

    # ---- requests
    async def generate(self, prompt: list[int], params: SamplingParams, outcome: Outcome) -> Outcome:
        assert self.dispatcher is not None
        try:
            async for out in self.dispatcher.generate(f"req-{next(self._ids)}", prompt, params):
                outcome.tokens += out.new_token_ids
                if out.new_token_ids:
                    outcome.token_times.append(time.time())
        except (NoCapacityError, RequestFailedError) as err:  # the clear errors a client may get
            outcome.error = err
        outcome.finished_at = time.time()
        return outcome

    async def probe_until_served(self, prompt: list[int], params: SamplingParams, timeout_s: float = 60.0) -> float:
        """Sends one request after another until one is served in full; returns time.time() then."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outcome = await asyncio.wait_for(self.generate(prompt, params, Outcome()), timeout_s)
            if outcome.error is None and len(outcome.tokens) == params.max_tokens:
                return outcome.finished_at
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no request was served within {timeout_s} s of the fault")

    # ---- the cluster's state
    async def wait_full_and_drained(self, timeout_s: float = 90.0) -> dict[str, int]:
        """Waits until every pool has its workers serving (replacements healthy and published) and
        no worker holds a block; returns each worker's held block count."""
        deadline = time.monotonic() + timeout_s
        held: dict[str, int] = {}
        while time.monotonic() < deadline:
            try:
                healthy = await asyncio.wait_for(self._all_healthy(), 10.0)
                held = await asyncio.wait_for(self.controller.held_blocks(), 10.0)
            except Exception:  # noqa: BLE001 - a replacement still starting
                healthy = False
            if healthy and set(held.values()) == {0}:
                await self.refresh()
                return held
            await asyncio.sleep(0.25)
        raise AssertionError(f"the cluster did not become whole and drained within {timeout_s} s: held={held}")

    async def _all_healthy(self) -> bool:
        for pool in self.pools.values():
            if len(pool.handles) != pool.num_workers:
                return False
            results = await asyncio.gather(*(h.health.remote() for h in pool.handles.values()))
            if not all(results):
                return False
        return True

    async def fault_fired_at(self, kind: str, since: float, timeout_s: float = 30.0) -> float:
        """time.time() of the first fault any worker of `kind` fired after `since` (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = await asyncio.gather(*(h.fault_stats.remote() for h in self.handles(kind).values()))
            times = [f[3] for s in stats for f in s["fired_at"] if f[3] >= since]
            if times:
                return min(times)
            await asyncio.sleep(0.02)
        raise TimeoutError(f"no armed fault fired on a {kind} worker within {timeout_s} s")


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
