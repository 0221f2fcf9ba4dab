"""Disaggregated serving on a local Ray cluster over gloo: 16 concurrent requests of mixed
lengths, greedy and seeded sampled, give the same tokens as the colocated mode and as the offline
engine, and every worker ends with no block held."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from engine import LLM, SamplingParams
from engine.llm import engine_config
from router import Dispatcher

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=512)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 120))] for _ in range(count)]


async def serve_requests(
    config: ClusterConfig, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[list[int]], dict[str, int]]:
    """Starts the pools, runs every request concurrently, and returns the tokens and the held
    block count of each worker once drained."""
    deployment = Deployment(config)
    await deployment.start()
    dispatcher = Dispatcher("router-0", deployment.workers(), poll_timeout_s=0.5)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in dispatcher.generate(f"req-{i}", prompt, params[i]):
            tokens += out.new_token_ids
        return tokens

    try:
        tokens = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 300)
        await dispatcher.close()
        held = await deployment.held_blocks()
    finally:
        deployment.shutdown()
    return tokens, held


def test_16_requests_disaggregated_equal_colocated_and_offline(ray_cluster):
    prompts = _prompts(16)
    # Every third request sampled with a seed: the decode worker continues the prefill's draws.
    params = [SamplingParams(max_tokens=random.Random(i).randrange(4, 24), temperature=0.0 if i % 3 else 0.8,
                             seed=i, ignore_eos=True) for i in range(16)]
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    engine = engine_config(**ENGINE)

    for mode in ("disaggregated", "colocated"):
        config = ClusterConfig(engine=engine, mode=mode, num_prefill=1, num_decode=1, transport="gloo")
        tokens, held = asyncio.run(serve_requests(config, prompts, params))
        assert set(held.values()) == {0}, held
        assert tokens == offline, mode
