"""Tensor-parallel workers on a local Ray cluster (gloo, CPU): each worker is rank 0 of two Ray
actors in its bundle. A colocated TP=2 pool gives the offline TP=1 tokens; and when one rank of a
worker is killed under load, the whole worker goes (its health check fails), its requests move to
the other worker and complete with exactly the offline tokens, the pool replaces it, and no block
is held anywhere once drained."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
from typing import Any

import pytest

from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from engine import LLM, SamplingParams
from engine.llm import engine_config
from router import Dispatcher

ray = pytest.importorskip("ray")
log = logging.getLogger(__name__)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


async def _generate(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for out in dispatcher.generate(rid, prompt, params) for t in out.new_token_ids]


def _rank_pids() -> list[int]:
    """The processes of live RankActors (Ray titles an actor process 'ray::RankActor...')."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RankActor"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return sorted(pids)


async def _rank_loops(deployment: Deployment, timeout_s: float = 30.0) -> dict[str, Any]:
    """Each decode worker's stats once its other rank has reported a forward (rank 0 reads the answer to the
    question its stats call before asked: one call behind)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = {i: await h.stats.remote() for i, h in deployment.decode.handles.items()}  # type: ignore[union-attr]
        if all(s.follower_forward_seconds > 0 for s in stats.values()) or \
                asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.2)


async def _serve(config: ClusterConfig, prompts: list[list[int]], params: SamplingParams,
                 kill_a_rank: bool) -> tuple[list[list[int]], dict[str, int], list[str], int]:
    deployment = Deployment(config)
    await deployment.start()
    log.info("deployment started")  # NOTE: each step logged: a run that reaches its time limit says where it was
    replaced: list[str] = []
    try:
        assert len(_rank_pids()) == config.num_decode  # one more rank per TP=2 worker
        dispatcher = Dispatcher("router-tp", deployment.workers(), poll_timeout_s=0.5)
        tasks = [asyncio.create_task(_generate(dispatcher, f"req-{i}", p, params)) for i, p in enumerate(prompts)]
        if kill_a_rank:
            await asyncio.sleep(1.0)  # NOTE: under load: every request is admitted and decoding by now
            assert not any(t.done() for t in tasks)
            os.kill(_rank_pids()[0], signal.SIGKILL)
        tokens = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        log.info("every request answered")
        migrations = dispatcher.num_migrations
        await dispatcher.close()
        if not kill_a_rank:
            # the rank actors' loops reach rank 0's stats through Ray: seconds launching forwards, in RankCalls
            for worker_id, stats in (await _rank_loops(deployment)).items():
                assert stats.follower_forward_seconds > 0 and stats.follower_call_seconds > 0, (worker_id, stats)
        pool = deployment.decode
        dead = await pool.find_dead()
        for worker_id in dead:
            new_id = pool.replace(worker_id)
            assert await pool.await_replacement(new_id)
            log.info("%s replaced by %s", worker_id, new_id)
            replaced.append(worker_id)
        held = await deployment.held_blocks(timeout_s=60)  # NOTE: colocated workers, no push to wait for
    finally:
        deployment.shutdown()
    return tokens, held, replaced, migrations


def test_colocated_tp2_workers_equal_offline_tp1(ray_cluster: None) -> None:
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="colocated", num_decode=1, decode_tp=2,
                           transport="gloo")
    tokens, held, replaced, migrations = asyncio.run(_serve(config, prompts, params, kill_a_rank=False))
    assert tokens == offline
    assert set(held.values()) == {0} and not replaced and migrations == 0


# NOTE: its bounded waits (start 180 s, the answers 240, the replacement 180, the leak check 60) add up past the
# default 600 s: on a loaded 2-core machine a run took 401 s (16-20 s alone)
@pytest.mark.timeout(900)
def test_killing_one_rank_under_load_moves_its_requests_and_loses_nothing(ray_cluster: None) -> None:
    prompts = _prompts(10)
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="colocated", num_decode=2, decode_tp=2,
                           transport="gloo")
    tokens, held, replaced, migrations = asyncio.run(_serve(config, prompts, params, kill_a_rank=True))
    assert tokens == offline
    assert migrations >= 1, migrations  # the dead worker's requests went on elsewhere, their tokens exact
    assert len(replaced) == 1, replaced  # the worker whose rank died, whole
    assert set(held.values()) == {0}, held


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (4, 2)])  # 4: KV heads replicated
def test_disaggregated_across_layouts_equals_colocated(ray_cluster: None, prefill_tp: int, decode_tp: int) -> None:
    """Every prompt through the prefill worker (rule 'remote'): each decode rank receives its KV
    heads from the prefill ranks that hold them."""
    from router import DispatcherConfig, LocalPrefillConfig

    prompts = _prompts(8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=1, num_decode=1,
                           prefill_tp=prefill_tp, decode_tp=decode_tp, transport="gloo")

    async def serve() -> tuple[list[list[int]], dict[str, int], dict[str, Any]]:
        deployment = Deployment(config)
        await deployment.start()
        try:
            dispatcher = Dispatcher("router-tp", deployment.workers(), poll_timeout_s=0.5,
                                    config=DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote")))
            tokens = await asyncio.wait_for(
                asyncio.gather(*(_generate(dispatcher, f"req-{i}", p, params) for i, p in enumerate(prompts))), 240)
            await dispatcher.close()
            stats = {i: await h.stats.remote()
                     for i, h in deployment.prefill.handles.items()}  # type: ignore[union-attr]
            return tokens, await deployment.held_blocks(), stats
        finally:
            deployment.shutdown()

    tokens, held, stats = asyncio.run(serve())
    assert tokens == offline
    assert set(held.values()) == {0}, held
    pushed = sum(s.push_totals.num_pushed for s in stats.values())
    assert pushed == len(prompts), stats  # every prompt crossed between the layouts
