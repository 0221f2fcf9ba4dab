"""A worker changes role in place under load (cluster/flex_worker.py, WorkerPool.hand_over): on a
local Ray cluster (gloo, CPU), 2 prefill + 1 decode workers serve a stream of requests while
prefill-1 is drained, flips to decode keeping its engine, and joins the decode pool; every request
completes with the offline engine's tokens, the flipped worker then decodes requests of its own, and
no block is held anywhere. Then the last prefill worker of 1P1D, behind a router over request channels,
as the autoscaler applies the change (tests/gpu/test_role_flip_gpu.py: the same over NCCL)."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.autoscaler import Decision
from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from router import DispatcherConfig, LocalPrefillConfig, SloConfig
from tests.served import served, tokens_of

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=1024)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_prefill_worker_becomes_a_decode_worker_under_load(ray_cluster: None) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(20, 200))] for _ in range(40)]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, PARAMS)]
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=2, num_decode=1,
                           transport="gloo")

    async def run() -> tuple[list[list[int]], str, dict[str, int], dict[str, int], list[str], list[str]]:
        async with served(config, "router-flip") as (controller, dispatcher):
            first = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.1 * i))
                     for i in range(20)]  # under load while it flips
            await asyncio.sleep(0.5)
            assert not all(t.done() for t in first)
            await controller.flip("prefill-1", "decode", router_refresh_s=0.25)
            second = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.05 * (i - 20)))
                      for i in range(20, 40)]
            tokens = await asyncio.wait_for(asyncio.gather(*first, *second), 240)
            role = await controller.deployment.decode.handles["prefill-1"].role_name.remote()
            stats = {s.worker_id: s.num_requests for s in await controller.stats() if not isinstance(s, str)}
            held = await controller.held_blocks()
            pools = (sorted(controller.deployment.prefill.handles),  # type: ignore[union-attr]
                     sorted(controller.deployment.decode.handles))
        return tokens, role, stats, held, *pools

    tokens, role, stats, held, prefill_ids, decode_ids = asyncio.run(run())
    assert tokens == offline  # nothing lost or changed across the flip
    assert role == "decode" and prefill_ids == ["prefill-0"] and decode_ids == ["decode-0", "prefill-1"]
    assert stats["prefill-1"] > 0, stats  # it decoded requests of its own after the flip
    assert set(held.values()) == {0}, held


def test_the_last_prefill_worker_becomes_a_decode_worker_behind_a_router_over_channels(ray_cluster: None) -> None:
    """As a served router sees it (router/channels.py: a request channel per worker) and as the autoscaler
    applies it (ClusterController._apply: drain, flip, the decode workers told they compute every prompt),
    while prompts wait at the prefill worker (their calls are answered there, none retried elsewhere):
    decode-0 computes every prompt (no step budget) from the moment the routers see no prefill worker, and
    after the flip both decode workers take whole requests, in about equal shares."""
    rng = random.Random(4)
    # the first 20 long: several seconds of prefill queue at the prefill worker when it leaves the set
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(400, 800) if i < 20 else rng.randrange(20, 200))]
               for i in range(60)]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, PARAMS)]
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=1, num_decode=1,
                           transport="gloo")
    dispatch = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"),
                                slo=SloConfig(ttft_ms=1000, tpot_ms=200))
    seen = []  # decode-0's stats while the routers saw no prefill worker and the flip was not done

    async def run() -> tuple[list[list[int]], dict[str, int], dict[str, int], dict[str, bool]]:
        async with served(config, "router-flip-channels", dispatch, channels=True) as (controller, dispatcher):
            first = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.0))
                     for i in range(20)]  # a burst: prompts wait at the prefill worker as it leaves the set
            prefill = controller.deployment.prefill.handles["prefill-0"]
            for _ in range(500):  # bounded: the flip starts while several prompts are under way there
                stats = await prefill.stats.remote()
                if stats.num_waiting + stats.num_running >= 2:
                    break
                await asyncio.sleep(0.005)
            under_way = stats.num_waiting + stats.num_running
            flip = asyncio.ensure_future(controller._apply(Decision(0.0, "prefill", 0, "test", flip_to="decode")))
            while not flip.done():  # while the routers see no prefill worker, decode-0 computes every prompt
                if not controller.deployment.workers().prefill:
                    seen.append(await controller.deployment.decode.handles["decode-0"].stats.remote())
                await asyncio.sleep(0.1)
            await asyncio.wait_for(flip, 120)
            await asyncio.gather(*first)
            before = {s.worker_id: s.num_requests for s in await controller.stats() if not isinstance(s, str)}
            second = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.1 * (i - 20)))
                      for i in range(20, 60)]
            tokens = await asyncio.wait_for(asyncio.gather(*first, *second), 240)
            stats = [s for s in await controller.stats() if not isinstance(s, str)]
            after = {s.worker_id: s.num_requests - before.get(s.worker_id, 0) for s in stats}
            every = {s.worker_id: s.computes_every_prompt for s in stats}
            held = await controller.held_blocks()
        return tokens, after, held, every, dispatcher.num_migrations, under_way

    tokens, after, held, every, migrations, under_way = asyncio.run(run())
    assert under_way >= 2
    assert tokens == offline  # nothing lost or changed across the flip
    assert migrations == 0  # drained, not failed: the prompts under way on the leaving worker were answered there
    assert every == {"decode-0": True, "prefill-0": True}
    assert seen and all(s.computes_every_prompt for s in seen), [s.computes_every_prompt for s in seen]
    # the 40 requests after the flip: each decode worker took a share (the policy balances by queued tokens)
    assert sum(after.values()) == 40 and min(after.values()) >= 10, after
    assert set(held.values()) == {0}, held
