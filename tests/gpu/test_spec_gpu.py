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


def _random_eagle_head(out, seed: int):  # type: ignore[no-untyped-def]
    """An EAGLE-1 head of random weights for the default model (engine/spec/eagle_head.py's layout)."""
    import json

    from safetensors.torch import save_file

    from engine.models import DEFAULT_MODEL_DIR, load_arch
    from engine.models.llama import DecoderLayer

    raw = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()) | {"num_hidden_layers": 1}
    arch = load_arch(DEFAULT_MODEL_DIR)
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layers.0.{n}": torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in n else 0.0)
               for n, p in DecoderLayer(arch).named_parameters()}
    tensors["fc.weight"] = torch.randn(arch.hidden_size, 2 * arch.hidden_size, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_eagle_head_drafts_the_same_through_its_cuda_graphs_as_eagerly(make_llm, tmp_path):
    """The EAGLE proposer's head drafts through its loop graph (all K passes in one replay) and its
    decode graphs: every draft equals the eager head's, pass by pass (checked against transformers on
    the CPU: tests/unit/engine/test_eagle.py), greedy output is plain decoding's, sampled requests run
    through the loop too, nothing is held after."""
    torch.backends.cuda.matmul.allow_tf32 = False
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(3)
    plain = [o.outputs[0].token_ids for o in make_llm(**OPTIONS).generate(prompts, greedy)]
    spec = SpeculativeConfig(method="eagle", draft_model=str(_random_eagle_head(tmp_path / "head", 0)),
                             num_draft_tokens=4, enable_adaptive_draft_length=False)
    drafts = []
    for eager in (False, True):
        llm = make_llm(speculative=spec, enforce_eager=eager, **OPTIONS)
        assert (llm.engine.proposer.runner.graphs is None) == eager
        seen: list = []
        propose = llm.engine.proposer.propose

        def recording(requests, generator, seen=seen, propose=propose):  # type: ignore[no-untyped-def]
            out = propose(requests, generator)
            seen.extend((tuple(r.token_ids), tuple(d.token_ids)) for r, d in zip(requests, out) if d is not None)
            return out

        llm.engine.proposer.propose = recording
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
        drafts.append(list(seen))
        loop = llm.engine.proposer.loop
        assert (loop is None) == eager
        if not eager:
            runs = loop.num_runs
            assert runs > 0
            sampled = SamplingParams(max_tokens=24, temperature=0.9, ignore_eos=True)
            assert all(len(o.outputs[0].token_ids) == 24 for o in llm.generate(_prompts(4), sampled))
            assert loop.num_runs > runs
    assert len(drafts[0]) > 10 and drafts[0] == drafts[1]
