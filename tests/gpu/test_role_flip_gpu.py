"""On two CUDA GPUs with Ray (marked `gpu`): the adaptive mode's role change as its autoscaler makes it,
over NCCL. 1 prefill + 1 decode worker serve a stream of requests; the controller applies the decision
"the prefill pool gives its last worker to decoding" (ClusterController._apply: drain, flip in place,
tell the decode workers they compute every prompt); every request completes with the offline engine's
tokens, the flipped worker then computes and decodes requests of its own, both decode workers drop
the step budget, and no block is held. On CPU (gloo) tests/integration/test_role_flip.py flips a
prefill worker of two; this is the last one, on the transport and device the GPU machines serve on."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from cluster.autoscaler import Decision
from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from tests.served import served, tokens_of

ray = pytest.importorskip("ray")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

ENGINE = dict(device="cuda", dtype="float32", block_size=16, num_blocks=2048, itl_budget_ms=30.0)
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def test_the_last_prefill_worker_becomes_a_decode_worker_over_nccl() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(50, 600))] for _ in range(60)]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, PARAMS)]
    torch.cuda.empty_cache()
    config = ClusterConfig(engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=1, num_decode=1,
                           transport="nccl")

    async def run() -> tuple[list[list[int]], dict[str, object], dict[str, int]]:
        async with served(config, "router-flip-gpu") as (controller, dispatcher):
            first = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.02 * i))
                     for i in range(30)]  # under load while it flips
            await asyncio.sleep(0.3)
            assert not all(t.done() for t in first)
            await asyncio.wait_for(controller._apply(Decision(0.0, "prefill", 0, "test", flip_to="decode")), 120)
            second = [asyncio.ensure_future(tokens_of(dispatcher, f"r{i}", prompts[i], PARAMS, 0.02 * (i - 30)))
                      for i in range(30, 60)]
            tokens = await asyncio.wait_for(asyncio.gather(*first, *second), 240)
            stats = {s.worker_id: s for s in await controller.stats() if not isinstance(s, str)}
            held = await controller.held_blocks()
        return tokens, stats, held

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False)
    try:
        tokens, stats, held = asyncio.run(run())
    finally:
        ray.shutdown()
    assert tokens == offline  # nothing lost or changed across the flip
    assert sorted(stats) == ["decode-0", "prefill-0"]
    assert all(s.role == "decode" and s.computes_every_prompt for s in stats.values()), stats
    assert stats["prefill-0"].num_requests > 0, stats  # it served requests of its own after the flip
    assert set(held.values()) == {0}, held
