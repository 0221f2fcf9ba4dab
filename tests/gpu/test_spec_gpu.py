"""On a CUDA GPU (marked `gpu`): speculative decoding with the draft model's CUDA graphs (its
passes, and its loop graph drafting d_1 .. d_K in one replay) keeps greedy output exact, both when
the target as its own draft has every greedy draft accepted (two tokens to catch up a step) and
when a random draft has most rejected (one); sampled requests run through the loop graph too and
leave no block held (make_llm's leak check)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams, SpeculativeConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPTIONS = dict(device="cuda", dtype="float32", attention_backend="triton", num_blocks=256, max_num_seqs=8)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randint(3, 40))] for _ in range(6)]


def test_own_draft_through_the_loop_graph_accepts_every_greedy_draft(make_llm):
    torch.backends.cuda.matmul.allow_tf32 = False
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(0)
    plain = [o.outputs[0].token_ids for o in make_llm(**OPTIONS).generate(prompts, greedy)]
    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=4)
    llm = make_llm(speculative=spec, **OPTIONS)
    loop = llm.engine.proposer.loop
    assert loop is not None, "the draft model should capture its loop graph on CUDA"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
    assert loop.num_runs > 0
    stats = llm.engine.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens


def test_sampled_requests_draft_through_the_loop_graph(make_llm):
    sampled = SamplingParams(max_tokens=40, temperature=0.9, ignore_eos=True)
    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=4)
    llm = make_llm(speculative=spec, **OPTIONS)
    outputs = llm.generate(_prompts(1), sampled)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)
    assert llm.engine.proposer.loop.num_runs > 0
    # The target as its own draft, sampling at the same temperature: nearly every draft accepted.
    assert llm.engine.stats().spec_acceptance_rate > 0.9


def test_a_poor_draft_through_the_loop_graph_keeps_greedy_output(make_llm, hf_checkpoints):
    torch.backends.cuda.matmul.allow_tf32 = False
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2)
    plain = [o.outputs[0].token_ids for o in make_llm(**OPTIONS).generate(prompts, greedy)]
    spec = SpeculativeConfig(method="draft", draft_model=str(hf_checkpoints("llama")), num_draft_tokens=4,
                             enable_adaptive_draft_length=False)
    llm = make_llm(speculative=spec, **OPTIONS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
    assert llm.engine.proposer.loop.num_runs > 10
    assert llm.engine.stats().num_spec_rejections > 0
