"""The autoscaler on a local Ray cluster (gloo, CPU) under a rate step: light load, a burst of long
prompts that queues at the single prefill worker past the TTFT SLO (measured there: ~30k prompt
tokens/s, so 80k tokens queue for seconds), light load again. The prefill pool
grows while the burst lasts and shrinks back after it, at most two changes per step; every request
completes with the offline engine's tokens and no block is held at the end."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.autoscaler import AutoscalerConfig
from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from tests.served import served, tokens_of

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=16384)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_rate_step_grows_the_prefill_pool_and_shrinks_it_back(ray_cluster: None) -> None:
    rng = random.Random(2)
    light = [[rng.randrange(4, 2048) for _ in range(20)] for _ in range(6)]
    burst = [[rng.randrange(4, 2048) for _ in range(1000)] for _ in range(80)]
    after = [[rng.randrange(4, 2048) for _ in range(20)] for _ in range(8)]
    prompts = light + burst + after
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, PARAMS)]
    scaling = AutoscalerConfig(ttft_ms=100, tpot_ms=5000, max_gpus=3, max_prefill=2, sustain_s=1.0, cooldown_s=3.0)
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=1, num_decode=1,
                           transport="gloo", autoscaler=scaling)

    async def run() -> tuple[list[list[int]], list[tuple[float, str, int, str]], dict[str, int], list[int]]:
        sizes: list[int] = []
        async with served(config, "router-as", autoscale_interval_s=0.25,
                          on_follow=lambda c: sizes.append(c.deployment.prefill.num_workers)
                          ) as (controller, dispatcher):

            def one(i: int, prompt: list[int], delay_s: float):
                return tokens_of(dispatcher, f"r{i}", prompt, PARAMS, delay_s)

            tasks = [one(i, p, 0.5 * i) for i, p in enumerate(light)]  # 3 s of light load
            # 80,000 prompt tokens at once: seconds of a CPU prefill worker's work, past the TTFT SLO's share
            tasks += [one(len(light) + i, p, 3.0) for i, p in enumerate(burst)]
            start = 3.0 + 10.0  # then quiet, then light load again
            tasks += [one(len(light) + len(burst) + i, p, start + 0.5 * i) for i, p in enumerate(after)]
            tokens = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            await asyncio.sleep(6.0)  # the quiet after: the pool shrinks back
            decisions = await controller.decisions()
            held = await controller.held_blocks()
            trace = await controller.pressure_trace()
        return tokens, decisions, held, sizes, trace

    tokens, decisions, held, sizes, trace = asyncio.run(run())
    assert tokens == offline  # nothing lost, nothing changed, through every resize
    moves = [(pool, n) for _, pool, n, _ in decisions]
    assert moves == [("prefill", 2), ("prefill", 1)], decisions  # grew for the burst, shrank after: once each way
    assert 2 in sizes and sizes[-1] == 1
    assert set(held.values()) == {0}, held
    # every round's reading is kept: the burst's prefill pressure past 1 ("inf": prompts arriving past the rate),
    # two prefill workers, then one again
    assert any(s["prefill"] == "inf" or (s["prefill"] or 0.0) > 1.0 for s in trace)
    assert [s["num_prefill"] for s in trace][-1] == 1
    assert 2 in {s["num_prefill"] for s in trace} and all(s["wall_s"] > 1e9 for s in trace)


def test_a_decode_heavy_load_turns_the_prefill_worker_into_a_decode_worker(ray_cluster: None) -> None:
    """1P1D with a running batch of 1: a steady stream of long answers (20 a second, until the flip)
    fills the decode worker's batch while the prefill worker idles; with min_prefill 0 the prefill worker
    drains and becomes a decode worker (0P2D); both decode workers are then sent whole requests (as
    colocated workers) without the step budget; every request gives the offline tokens, no block held."""
    engine = dict(device="cpu", block_size=8, num_blocks=4096, max_num_seqs=1)  # NOTE: anything waiting presses
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    stream = [[rng.randrange(4, 2048) for _ in range(20)] for _ in range(160)]  # at most 8 s of arrivals
    later = [[rng.randrange(4, 2048) for _ in range(20)] for _ in range(12)]
    # NOTE: sustain 3 s: an idle prefill pool before the load arrives would otherwise just shrink
    scaling = AutoscalerConfig(ttft_ms=5000, tpot_ms=5000, max_gpus=2, min_prefill=0, sustain_s=3.0, cooldown_s=3.0)
    config = ClusterConfig(engine=engine_config(**engine, itl_budget_ms=4000.0), mode="disaggregated", num_prefill=1,
                           num_decode=1, transport="gloo", autoscaler=scaling)

    async def run():
        sent: list[list[int]] = []
        async with served(config, "router-flip", autoscale_interval_s=0.25) as (controller, dispatcher):

            def one(rid: str, prompt: list[int]):
                return tokens_of(dispatcher, rid, prompt, params)

            first = []
            for prompt in stream:  # until the prefill pool has given its worker away
                if controller.deployment.prefill.num_workers == 0:  # type: ignore[union-attr]
                    break
                first.append(asyncio.ensure_future(one(f"s{len(sent)}", prompt)))
                sent.append(prompt)
                await asyncio.sleep(0.05)
            for _ in range(160):  # the flip under way (drained, changed, joined the decode pool): at most 40 s more
                if controller.deployment.decode.num_workers == 2:
                    break
                await asyncio.sleep(0.25)
            await asyncio.sleep(2.5)  # every router has the new set (the controller publishes, then waits 2 s)
            second = [asyncio.ensure_future(one(f"l{i}", p)) for i, p in enumerate(later)]
            tokens = await asyncio.wait_for(asyncio.gather(*first, *second), 300)
            stats = [s for s in await controller.stats() if not isinstance(s, str)]
            decisions = await controller.decisions()
            held = await controller.held_blocks()
        return sent + later, tokens, stats, decisions, held

    prompts, tokens, stats, decisions, held = asyncio.run(run())
    assert tokens == [o.outputs[0].token_ids for o in LLM(**engine).generate(prompts, params)]  # nothing lost
    assert [(pool, n) for _, pool, n, _ in decisions] == [("prefill", 0)], decisions
    assert "becomes a decode worker" in decisions[0][3]
    assert [s.role for s in stats] == ["decode", "decode"] and all(s.computes_every_prompt for s in stats)
    flipped = next(s for s in stats if s.worker_id.startswith("prefill"))
    assert flipped.num_requests > 0  # it decodes requests of its own now
    assert set(held.values()) == {0}, held
