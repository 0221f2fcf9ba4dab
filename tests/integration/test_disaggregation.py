"""Disaggregated serving on a local Ray cluster over gloo: 16 concurrent requests of mixed
lengths, greedy and seeded sampled, give the same tokens as the colocated mode and as the offline engine, and every
worker ends with no block held. Disaggregated, they are served twice by one deployment: first
with prefill rule 'short_or_cached' (the short prompts are prefilled on the decode worker, never
reaching the prefill worker or taking a lease; the long ones go through the prefill worker), then
with every prompt through the prefill worker (rule 'remote')."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import pytest

from cluster.config import ClusterConfig
from cluster.deployment import Deployment
from engine import LLM, SamplingParams
from engine.llm import engine_config
from router import Dispatcher, DispatcherConfig, LocalPrefillConfig, Workers
from tests.spy import Spy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(device="cpu", block_size=8, num_blocks=512)
RULES = {  # NOTE: a threshold of its own, so that these prompts (3 to 119 tokens) take both paths
    "short_or_cached": DispatcherConfig(local_prefill=LocalPrefillConfig(max_short_prompt_tokens=64)),
    "remote": DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote")),
}


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 120))] for _ in range(count)]


async def _generate(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for out in dispatcher.generate(rid, prompt, params) for t in out.new_token_ids]


async def serve_requests(
    config: ClusterConfig, prompts: list[list[int]], params: list[SamplingParams], rules: list[str]
) -> tuple[dict[str, list[list[int]]], dict[str, dict[str, list[str]]], dict[str, int]]:
    """Starts the pools and, once per prefill rule, runs every request concurrently; returns each
    rule's tokens and protocol calls (by method), and the held block count of each worker once drained."""
    deployment = Deployment(config)
    await deployment.start()
    tokens: dict[str, list[list[int]]] = {}
    calls: dict[str, dict[str, list[str]]] = {}
    try:
        for rule in rules:
            calls[rule] = defaultdict(list)
            workers = deployment.workers()
            spied = Workers.of(prefill={i: Spy(c.target, calls[rule]) for i, c in workers.prefill.items()},
                               decode={i: Spy(c.target, calls[rule]) for i, c in workers.decode.items()})
            # NOTE: a router id per run: a closed Dispatcher's last poll may still take its router's tokens.
            dispatcher = Dispatcher(f"router-{rule}", spied, poll_timeout_s=0.5, config=RULES[rule])

            tokens[rule] = await asyncio.wait_for(
                asyncio.gather(*(_generate(dispatcher, f"req-{i}", p, params[i]) for i, p in enumerate(prompts))), 300
            )
            await dispatcher.close()
        held = await deployment.held_blocks()
    finally:
        deployment.shutdown()
    return tokens, calls, held


def test_16_requests_disaggregated_equal_colocated_and_offline(ray_cluster):
    prompts = _prompts(16)
    # Every third request sampled with a seed: the decode worker continues the prefill's draws.
    params = [SamplingParams(max_tokens=random.Random(i).randrange(4, 24), temperature=0.0 if i % 3 else 0.8,
                             seed=i, ignore_eos=True) for i in range(16)]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    engine = engine_config(**ENGINE)
    short = RULES["short_or_cached"].local_prefill.max_short_prompt_tokens
    short_ids = {f"req-{i}" for i, p in enumerate(prompts) if len(p) < short}
    long_ids = {f"req-{i}" for i, p in enumerate(prompts) if len(p) >= short}
    assert short_ids and long_ids

    for mode in ("disaggregated", "colocated"):
        config = ClusterConfig(engine=engine, mode=mode, num_prefill=1, num_decode=1, transport="gloo")
        rules = list(RULES) if mode == "disaggregated" else ["short_or_cached"]
        tokens, calls, held = asyncio.run(serve_requests(config, prompts, params, rules))
        assert set(held.values()) == {0}, held
        for rule in rules:
            assert tokens[rule] == offline, (mode, rule)
        if mode == "disaggregated":
            assert set(calls["short_or_cached"]["prefill_locally"]) == short_ids
            assert set(calls["short_or_cached"]["prefill"]) == set(calls["short_or_cached"]["reserve"]) == long_ids
            assert not calls["remote"]["prefill_locally"]
            assert set(calls["remote"]["prefill"]) == short_ids | long_ids


def test_a_decode_worker_runs_at_most_max_num_seqs_and_the_rest_wait_their_turn(ray_cluster):
    """16 concurrent requests, each prefilled by the prefill worker, onto a decode worker with a batch of
    4: it never runs more than 4, the pushed ones past them wait holding their KV, and every request
    ends with the offline engine's tokens."""
    prompts = _prompts(16, seed=1)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    small = dict(ENGINE, max_num_seqs=4)
    offline = [o.outputs[0].token_ids for o in LLM(**small).generate(prompts, params)]
    config = ClusterConfig(engine=engine_config(**small), mode="disaggregated", num_prefill=1, num_decode=1,
                           transport="gloo")

    async def main() -> tuple[list[list[int]], list[tuple[int, int]], dict[str, int]]:
        deployment = Deployment(config)
        await deployment.start()
        try:
            (decode,) = deployment.decode.handles.values()
            dispatcher = Dispatcher("router-cap", deployment.workers(), poll_timeout_s=0.5, config=RULES["remote"])
            seen: list[tuple[int, int]] = []

            async def watch() -> None:
                for _ in range(2000):  # NOTE: bounded; cancelled once the requests end
                    stats = await decode.stats.remote()
                    seen.append((stats.num_running, stats.num_waiting))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            tokens = await asyncio.wait_for(asyncio.gather(
                *(_generate(dispatcher, f"req-{i}", p, params[i]) for i, p in enumerate(prompts))), 300)
            watcher.cancel()
            await dispatcher.close()
            return tokens, seen, await deployment.held_blocks()
        finally:
            deployment.shutdown()

    tokens, seen, held = asyncio.run(main())
    assert tokens == offline
    assert set(held.values()) == {0}, held
    assert max(r for r, _ in seen) == 4  # full, never past it
    assert any(r == 4 and w > 0 for r, w in seen)  # pushed requests waited for a place
