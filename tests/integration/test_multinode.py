"""Multi-node placement, node loss and pool resizing on a cluster simulated on one machine
(`ray.cluster_utils.Cluster`): a head with no pdserve resource, a node with `pdserve_prefill: 1` and
one with `pdserve_decode: 1`, as the cluster YAMLs in deploy/clusters/ lay a real cluster out.

- The pools land on the nodes carrying their resources, and requests served across nodes over
  gloo give the offline engine's tokens.
- The decode node dies mid-load: its requests end, never hang: moved by the router to the
  replacement worker (and then complete) or with a clear error. The pool's
  supervisor replaces the worker on a node added with the decode resource (what an autoscaler
  does), and new requests are served again; the time this takes is printed.
- The decode pool is resized 1 -> 2 -> 1 under load: no request fails, every one gives the offline
  engine's tokens, and no block is held afterwards.

Ordering: this module needs Ray to itself. The session fixture `ray_cluster`
(tests/integration/conftest.py) starts a plain local Ray the first time a test asks for it; if it
is up when this module starts, `sim_cluster` shuts it down and, when this module is done, starts
it again the same way, so tests that run later with `ray_cluster` still find it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from decode_worker import DecodeWorkerConfig
from prefill_worker import PrefillWorkerConfig
from cluster.config import DECODE_RESOURCE, PREFILL_RESOURCE, ClusterConfig
from cluster.controller import ClusterController
from engine import LLM, SamplingParams
from engine.llm import engine_config
from router import Dispatcher, NoCapacityError, RequestFailedError, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig
from router.follow import WorkerSetFollower

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from kvtransfer.netaddr import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
RUNTIME_ENV = {"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}}
# A crashed node is declared dead after about period x threshold; Ray's defaults (3 s x 5) would
# make the node-loss test wait ~15 s for it. The figure printed below is with these settings.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
LONG = 600  # max_tokens of the requests decoding when their node is lost
PROMPTS = [[random.Random(i).randrange(4, 2048) for _ in range(random.Random(-i).randrange(3, 60))] for i in range(12)]


@pytest.fixture(scope="module")
def sim_cluster() -> Iterator[Cluster]:
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()  # the session's plain local Ray: started again below
    assert not ray.is_initialized()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cluster = Cluster(
        initialize_head=True,
        # The dashboard serves ray.util.state (where each actor runs); on a free port, never 8265.
        head_node_args=dict(num_cpus=1, dashboard_port=free_port(), _system_config=FAST_NODE_DEATH),
    )
    try:
        cluster.add_node(num_cpus=1, resources={PREFILL_RESOURCE: 1})
        cluster.add_node(num_cpus=1, resources={DECODE_RESOURCE: 1})
        ray.init(address=cluster.address, runtime_env=RUNTIME_ENV, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_up:  # as tests/integration/conftest.py's ray_cluster starts it
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, runtime_env=RUNTIME_ENV)


@pytest.fixture(scope="module")
def offline() -> dict[tuple[int, int], list[int]]:
    """The offline engine's greedy tokens, by (prompt index, max_tokens)."""
    llm = LLM(**ENGINE)
    cases = [(i, 24) for i in range(len(PROMPTS))] + [(i, 8) for i in range(0, 8, 2)]
    outs = llm.generate([PROMPTS[i] for i, _ in cases], [_params(n) for _, n in cases])
    return {case: out.outputs[0].token_ids for case, out in zip(cases, outs)}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _config(**overrides: Any) -> ClusterConfig:
    return ClusterConfig(
        engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=1, num_decode=1, transport="gloo",
        prefill_resources={PREFILL_RESOURCE: 1}, decode_resources={DECODE_RESOURCE: 1},
        prefill=PrefillWorkerConfig(transfer_timeout_s=5.0),
        decode=DecodeWorkerConfig(transfer_timeout_s=5.0, lease_ttl_s=5.0), **overrides,
    )


class Serving:
    """A ClusterController in this process and one router (a Dispatcher) following its worker
    set the way a Serve router replica does: it polls the controller's version."""

    def __init__(self, config: ClusterConfig) -> None:
        self.controller = ClusterController(config, health_interval_s=0.5)
        self.dispatcher: Dispatcher | None = None
        self.follower: WorkerSetFollower | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> Serving:
        await asyncio.wait_for(self.controller.start(), 120)
        # NOTE: every prompt through the prefill node (these prompts are short): the KV crosses nodes.
        remote = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))
        self.dispatcher = Dispatcher("router-0", Workers({}, {}), poll_timeout_s=0.5, config=remote)
        # Follows the controller the way a Serve router replica does, only more often.
        self.follower = WorkerSetFollower(self.dispatcher, self.controller.workers, interval_s=0.1)
        await self.follower.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.follower is not None:
            self.follower.stop()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await self.controller.shutdown()

    async def refresh(self) -> None:
        assert self.follower is not None
        await self.follower.refresh()

    async def publish(self) -> None:
        """WorkerPool.resize's hook: the worker set changed; returns once the router has it."""
        self.controller.version += 1
        await self.refresh()

    async def generate(
        self, prompt_index: int, max_tokens: int, first_tokens: asyncio.Event | None = None
    ) -> list[int]:
        tokens: list[int] = []
        async for out in self.dispatcher.generate(f"req-{next(self._ids)}", PROMPTS[prompt_index], _params(max_tokens)):
            tokens += out.new_token_ids
            if first_tokens is not None and len(tokens) >= 3:
                first_tokens.set()
        return tokens

    @property
    def pools(self) -> dict[str, Any]:
        deployment = self.controller.deployment
        return {"prefill": deployment.prefill, "decode": deployment.decode}


def _actor_nodes() -> dict[str, str]:
    """Live actor name -> the id of the node it runs on."""
    return {a.name: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")], timeout=10) if a.name}


def _node_resources() -> dict[str, dict[str, float]]:
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}


def _assert_placed(serving: Serving, timeout_s: float = 15.0) -> dict[str, str]:
    """Every worker runs on a node offering its pool's resource; returns worker id -> node id.
    NOTE: Ray's state API lags the actors themselves: wait (bounded) until it lists every worker."""
    names = {f"pdserve-{w}" for kind in ("prefill", "decode") for w in serving.pools[kind].handles}
    deadline = time.monotonic() + timeout_s
    while not names <= set(nodes := _actor_nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    resources = _node_resources()
    placed = {}
    for kind, resource in (("prefill", PREFILL_RESOURCE), ("decode", DECODE_RESOURCE)):
        for worker_id in serving.pools[kind].handles:
            node_id = nodes[f"pdserve-{worker_id}"]
            assert resources[node_id].get(resource, 0) >= 1, (worker_id, resource, resources[node_id])
            placed[worker_id] = node_id
    return placed


async def _assert_drained(serving: Serving) -> None:
    held = await asyncio.wait_for(serving.controller.held_blocks(), 30)
    assert set(held.values()) == {0}, held


def test_pools_land_on_their_nodes_and_serve_across_nodes(sim_cluster, offline):
    async def run() -> None:
        async with Serving(_config()) as serving:
            placed = _assert_placed(serving)
            assert placed["prefill-0"] != placed["decode-0"]
            cases = [(i, 24 if i % 2 else 8) for i in range(8)]
            tokens = await asyncio.wait_for(asyncio.gather(*(serving.generate(i, n) for i, n in cases)), 60)
            assert tokens == [offline[c] for c in cases]
            await _assert_drained(serving)

    asyncio.run(run())


def test_decode_node_lost_mid_load_its_requests_end_and_new_ones_are_served_on_a_new_node(sim_cluster, offline):
    # The node the autoscaler brings up for the lost one, up before the loss: its boot time (minutes
    # on a cloud) is not pdserve's and is left out of the figure. NOTE: Cluster.add_node only runs
    # on the main thread, so it cannot be added while the event loop below runs.
    sim_cluster.add_node(num_cpus=1, resources={DECODE_RESOURCE: 1})

    async def run() -> None:
        async with Serving(_config()) as serving:
            lost_id = "decode-0"
            lost_node_id = _assert_placed(serving)[lost_id]
            lost_node = next(n for n in sim_cluster.worker_nodes if n.node_id == lost_node_id)
            # Long enough (3 x (<60 + 600) tokens fill most of the 2048-token KV cache) to be decoding
            # on decode-0 for seconds after the loss.
            started = [asyncio.Event() for _ in range(3)]
            in_flight = [asyncio.ensure_future(serving.generate(i, LONG, started[i])) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)

            removed_at = time.monotonic()
            await asyncio.to_thread(sim_cluster.remove_node, lost_node, False)  # a crash, not a drain

            async def next_served() -> tuple[float, int]:
                """A client sending a new request every 0.2 s until one is served: (seconds from
                the loss, attempts refused before)."""
                num_refused = 0
                while True:
                    assert time.monotonic() - removed_at < 60, "nothing served 60 s after the node was lost"
                    try:
                        tokens = await asyncio.wait_for(serving.generate(0, 8), 30)
                    except Exception:  # noqa: BLE001 - refused or failed while the worker is replaced
                        num_refused += 1
                        await asyncio.sleep(0.2)
                        continue
                    assert tokens == offline[(0, 8)]
                    return time.monotonic() - removed_at, num_refused

            async def lost_requests_end() -> tuple[list[Any], float]:
                results = await asyncio.gather(*in_flight, return_exceptions=True)
                return results, time.monotonic() - removed_at

            # NOTE: a hang here fails the test (wait_for), so each request must end on its own: moved
            # by the router to another worker, and complete; or with the router's error, naming the
            # lost worker, or saying no decode worker is left to move it to.
            (results, ended_s), (served_s, num_refused) = await asyncio.wait_for(
                asyncio.gather(lost_requests_end(), next_served()), 60
            )
            num_failed = 0
            for result in results:
                if isinstance(result, BaseException):
                    assert isinstance(result, NoCapacityError) or (
                        isinstance(result, RequestFailedError) and lost_id in str(result)
                    ), repr(result)
                    num_failed += 1
                else:  # the continuation's tokens are the Dispatcher's tests' to check
                    assert len(result) == LONG
            print(
                f"\n[multinode] decode node lost: of its {len(results)} requests {num_failed} failed and "
                f"{len(results) - num_failed} moved, all ended {ended_s:.1f} s after the loss; a new request was "
                f"served {served_s:.1f} s after it ({num_refused} attempts refused before)"
            )
            assert serving.controller.num_replaced == 1
            placed = _assert_placed(serving)
            (new_id,) = serving.pools["decode"].handles
            assert new_id != lost_id and placed[new_id] != lost_node_id
            cases = [(i, 24) for i in range(4)]
            tokens = await asyncio.wait_for(asyncio.gather(*(serving.generate(i, n) for i, n in cases)), 60)
            assert tokens == [offline[c] for c in cases]
            await _assert_drained(serving)

    asyncio.run(run())


def test_decode_pool_resized_1_2_1_under_load_loses_no_request(sim_cluster, offline):
    num_decode_nodes = sum(1 for r in _node_resources().values() if r.get(DECODE_RESOURCE, 0) >= 1)
    for _ in range(2 - num_decode_nodes):
        sim_cluster.add_node(num_cpus=1, resources={DECODE_RESOURCE: 1})

    async def run() -> None:
        async with Serving(_config()) as serving:
            pool = serving.pools["decode"]
            done: list[tuple[tuple[int, int], list[int] | BaseException]] = []
            is_loading = True

            async def client(seed: int) -> None:
                rng = random.Random(seed)
                while is_loading:
                    case = (rng.randrange(len(PROMPTS)), 24)
                    try:
                        done.append((case, await asyncio.wait_for(serving.generate(*case), 60)))
                    except Exception as err:  # noqa: BLE001 - counted as lost below
                        done.append((case, err))

            async def until_running(worker_id: str) -> None:
                while (await pool.handles[worker_id].stats.remote()).num_running == 0:
                    await asyncio.sleep(0.05)

            clients = [asyncio.ensure_future(client(seed)) for seed in range(4)]
            await asyncio.sleep(1.0)
            (added,) = await pool.resize(2, serving.publish, ready_timeout_s=60)
            placed = _assert_placed(serving)
            assert placed[added] != placed["decode-0"]
            await asyncio.wait_for(until_running(added), 30)  # the load reaches the new worker

            busy_when_retiring: list[dict[str, Any]] = []

            async def publish() -> None:
                await serving.publish()
                if pool.retiring:  # what the victim still had to finish when routers stopped leasing on it
                    busy_when_retiring.append(await pool.handles[added].stats.remote())

            shrink_started = time.monotonic()
            retired = await pool.resize(1, publish, drain_timeout_s=60)
            drained_s = time.monotonic() - shrink_started
            assert retired == [added]  # the newest goes first
            (busy,) = busy_when_retiring
            assert busy.num_running + busy.num_leases > 0, busy  # so the drain had work to do
            assert list(pool.handles) == ["decode-0"] and not pool.retiring
            await asyncio.sleep(1.0)  # and serving goes on with one decode worker
            is_loading = False
            await asyncio.wait_for(asyncio.gather(*clients), 60)

            lost = [(case, result) for case, result in done if isinstance(result, BaseException)]
            assert not lost, lost
            assert all(tokens == offline[case] for case, tokens in done)
            print(f"\n[multinode] resize 1 -> 2 -> 1 under load: {len(done)} requests, none lost; shrinking drained "
                  f"{retired[0]} ({busy.num_running} running, {busy.num_leases} leased) in {drained_s:.1f} s")
            assert f"pdserve-{added}" not in _actor_nodes()
            await _assert_drained(serving)

    asyncio.run(run())
