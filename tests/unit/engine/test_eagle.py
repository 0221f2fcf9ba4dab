"""The EAGLE proposer (engine/spec/eagle.py) against a reference built from transformers: every draft
it proposes equals the greedy drafts of transformers' LlamaDecoderLayer run as an EAGLE-1 head (fc
over the token's embedding and the target's last hidden state, no input norm, the target's lm_head)
over the whole sequence; a head that reproduces a one-layer target has every greedy draft accepted;
output is the output without speculation (greedy, seeded), through chunked prefill, prefix caching
and preemption; and bad heads or layouts are refused by name. make_llm's leak check runs
EngineCore.check_integrity, which checks the proposer's state too."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from engine import SamplingParams, SpeculativeConfig
from engine.config import EngineConfig
from tests.builders import load_hf_model, make_hf_checkpoint
from tests.eagle_builders import ReferenceHead, oracle_head, record_proposals

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, lengths: tuple[int, ...] = (9, 23, 5, 41)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in lengths]


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("eagle_target"), seed=3)


def _eagle(head_dir: Path, k: int = 3, **options: Any) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", draft_model=str(head_dir), num_draft_tokens=k, **options)


def test_every_draft_equals_transformers_eagle_head(make_llm, target_path, tmp_path):
    target = load_hf_model(target_path)
    reference = ReferenceHead(target, seed=5)
    head_dir = reference.save(tmp_path / "head")
    prompts = _prompts(0)
    plain = _tokens(make_llm(str(target_path), block_size=4).generate(prompts, GREEDY))
    # A 16-token budget: the long prompts prefill in chunks (features fed a chunk at a time).
    llm = make_llm(str(target_path), block_size=4, max_num_batched_tokens=16, speculative=_eagle(head_dir))
    proposals = record_proposals(llm)
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    # Again after a prefix of the longest prompt: its cached blocks carry the head's KV.
    again = [prompts[3][:30] + [7, 8, 9]]
    starts: list[int] = []
    observe = llm.engine.runner.observer
    llm.engine.runner.observer = lambda scheduled, *rest: (starts.append(scheduled[0].request.num_computed_tokens),
                                                           observe(scheduled, *rest))
    assert _tokens(llm.generate(again, GREEDY)) == _tokens(make_llm(str(target_path), block_size=4).generate(again,
                                                                                                             GREEDY))
    assert starts[0] == 28, "the prompt's first 7 blocks were found cached"
    assert len(proposals) >= 20
    for tokens, draft in proposals:
        want = reference.greedy_drafts(tokens, len(draft))
        assert draft.token_ids == want, f"drafts after {len(tokens)} tokens"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    one_layer = make_hf_checkpoint("llama", tmp_path_factory.mktemp("one_layer"), seed=4, num_hidden_layers=1)
    return oracle_head(one_layer, tmp_path_factory.mktemp("oracle"))


def test_a_head_that_reproduces_its_target_has_every_greedy_draft_accepted(make_llm, oracle):
    prompts = _prompts(1)
    target = str(oracle / "target")
    plain = _tokens(make_llm(target, block_size=4).generate(prompts, GREEDY))
    llm = make_llm(target, block_size=4, speculative=_eagle(oracle / "head", k=4))
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_rejections == 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    assert stats.num_spec_verifications < 4 * 19 / 2  # most steps yield several tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_output_is_unchanged_through_preemption_and_prefix_caching(make_llm, oracle, prefix_caching):
    """A shared prefix (cached blocks carry the head's KV) and a pool so small that requests are
    preempted and recomputed: greedy and seeded outputs equal plain decoding's."""
    shared = _prompts(2, (12,))[0]
    prompts = [shared + p for p in _prompts(3, (5, 9, 14))] + [shared]
    seeded = SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    params = [greedy, seeded, greedy, seeded]
    target = str(oracle / "target")
    options = dict(block_size=4, num_blocks=22, enable_prefix_caching=prefix_caching)
    plain = _tokens(make_llm(target, **options).generate(prompts, params))
    llm = make_llm(target, speculative=_eagle(oracle / "head", k=4), **options)
    final: dict[str, list[int]] = {}
    for step in llm.stream(prompts, params):
        llm.engine.check_integrity()  # the proposer holds state only for running requests, every step
        final.update((o.request_id, o.outputs[0].token_ids) for o in step)
    assert [final[k] for k in sorted(final, key=int)] == plain
    stats = llm.engine.stats()
    assert stats.num_spec_accepted_tokens > 0
    assert stats.num_preemptions > 0, "the pool is small enough to preempt"


def test_bad_heads_and_layouts_are_refused_by_name(make_llm, target_path, tmp_path):
    reference = ReferenceHead(load_hf_model(target_path), seed=6)
    head = reference.save(tmp_path / "head")
    raw = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(raw | {"hidden_size": 32}))
    with pytest.raises(ValueError, match="hidden_size is 32"):
        make_llm(str(target_path), block_size=4, speculative=_eagle(head))
    (head / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="num_hidden_layers is 2"):
        make_llm(str(target_path), block_size=4, speculative=_eagle(head))
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="eagle")
    engine = EngineConfig(speculative=_eagle(head))
    with pytest.raises(ValueError, match="method='eagle' runs in colocated workers"):
        ClusterConfig(engine=engine, mode="disaggregated")
    assert ClusterConfig(engine=engine).mode == "colocated"


def test_long_runs_without_drafts_feed_the_head_under_asynchronous_steps(make_llm, target_path, tmp_path):
    """Two requests decode 70 steps without drafting (the batch is over disable_above_batch_size), in
    asynchronous steps whose last token is a placeholder until read: once one request is left alone,
    the head catches up on all of them from the feature cache and its drafts are the reference's."""
    target = load_hf_model(target_path)
    reference = ReferenceHead(target, seed=7)
    head_dir = reference.save(tmp_path / "head")
    prompts = _prompts(4, (6, 11))
    params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=72, temperature=0.0, ignore_eos=True)]
    plain = _tokens(make_llm(str(target_path), block_size=4).generate(prompts, params))
    llm = make_llm(str(target_path), block_size=4, async_scheduling=True,
                   speculative=_eagle(head_dir, disable_above_batch_size=1))
    assert llm.engine.async_scheduling
    proposals = record_proposals(llm)
    assert _tokens(llm.generate(prompts, params)) == plain
    assert proposals and all(len(tokens) > 70 for tokens, _ in proposals)
    for tokens, draft in proposals:
        assert draft.token_ids == reference.greedy_drafts(tokens, len(draft))
