"""Speculative decoding in the engine's continuous batch: greedy output is the output without
speculation, for the n-gram and the draft-model proposers, batched with requests that do not
speculate, through preemption, stops and aborts; the draft's own KV blocks are all freed after
(make_llm's leak check runs EngineCore.check_integrity, which checks the draft pool too)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import LLM, SamplingParams, SpeculativeConfig
from engine.kv_cache import IntegrityError
from engine.request import Request
from engine.spec import adaptive
from engine.spec.ngram import lookup

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (n-gram lookup finds them) and random ones of different lengths."""
    rng = random.Random(seed)
    motif = [rng.randrange(4, 2048) for _ in range(6)]
    return [
        motif * 4,
        [rng.randrange(4, 2048) for _ in range(9)],
        motif * 2 + [rng.randrange(4, 2048) for _ in range(30)] + motif,
        [rng.randrange(4, 2048) for _ in range(45)],
    ]


def _speculative(method: str, draft: Any = None, **options: Any) -> SpeculativeConfig:
    if method == "draft":
        return SpeculativeConfig(method="draft", draft_model=str(draft), **options)
    return SpeculativeConfig(method="ngram", **options)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _record_steps(llm: LLM) -> list[tuple[int, int]]:
    """Per executed step: (requests verifying drafts, other requests) — wraps the runner."""
    seen: list[tuple[int, int]] = []
    execute = llm.engine.runner.execute

    def recording(scheduled, *args):  # type: ignore[no-untyped-def]
        spec = sum(1 for s in scheduled if s.num_spec_tokens)
        seen.append((spec, len(scheduled) - spec))
        return execute(scheduled, *args)

    llm.engine.runner.execute = recording  # type: ignore[method-assign]
    return seen


@pytest.fixture(params=["ngram", "draft"])
def method(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def other_draft(hf_checkpoints) -> Any:
    """A random checkpoint of the default model's vocabulary, unlike the default model: a poor draft."""
    return hf_checkpoints("llama")


def test_greedy_output_is_unchanged_batched_with_plain_requests(make_llm, method, other_draft):
    prompts = _prompts()
    plain = _tokens(make_llm(block_size=4).generate(prompts, GREEDY))
    # A 24-token budget: long prompts prefill in chunks while the short ones verify drafts.
    llm = make_llm(block_size=4, max_num_batched_tokens=24, speculative=_speculative(method, other_draft))
    steps = _record_steps(llm)
    assert _tokens(llm.generate(prompts, GREEDY)) == plain
    stats = llm.engine.stats()
    assert stats.num_spec_verifications > 0 and stats.num_spec_draft_tokens > 0
    assert any(spec and other for spec, other in steps), "a step mixes verifying and plain requests"
    if method == "ngram":
        assert stats.num_spec_accepted_tokens > 0  # the repeated motifs are found and continued


def _own_draft_accepts_every_draft(make_llm, prompts, params, num_draft_tokens: int) -> Any:
    """The target as its own draft: the tokens of plain decoding, every greedy draft accepted; its stats."""
    plain = _tokens(make_llm(block_size=4).generate(prompts, params))
    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=num_draft_tokens)
    llm = make_llm(block_size=4, speculative=spec)
    assert _tokens(llm.generate(prompts, params)) == plain
    stats = llm.engine.stats()
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens and stats.num_spec_rejections == 0
    return stats


def test_target_as_its_own_draft_accepts_every_greedy_draft(make_llm):
    stats = _own_draft_accepts_every_draft(make_llm, _prompts(1), GREEDY, num_draft_tokens=5)
    assert stats.spec_acceptance_rate == 1.0
    # Each verification yields its drafts plus one: 24 tokens, the first from the prefill.
    assert stats.num_spec_emitted_tokens == 4 * 23
    assert stats.num_spec_verifications < 4 * 23 / 2


def test_own_draft_accepts_every_greedy_draft_with_penalties_too(make_llm):
    """Penalized requests beside plain ones (the draft model then reads each drafting pass before the
    next, where it otherwise reads its drafts once a propose): the target, as its own draft, still
    accepts every greedy draft, so the penalties reach the draft's passes as they reach the target."""
    prompts = _prompts(2)
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    _own_draft_accepts_every_draft(make_llm, prompts, [penalized, GREEDY, GREEDY, penalized], num_draft_tokens=4)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_speculation_gives_same_tokens(make_llm, method, other_draft, prefix_caching):
    prompts = _prompts(2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _tokens(make_llm(block_size=4).generate(prompts, params))
    draft = "default" if method == "draft" else None  # accepts all: long runs, the most blocks at stake
    llm = make_llm(
        block_size=4, num_blocks=34, enable_prefix_caching=prefix_caching, speculative=_speculative(method, draft)
    )
    outputs = []
    for step in llm.stream(prompts, params):
        llm.engine.check_integrity()  # target and draft pools consistent after every step
        outputs.append(step)
    final = {o.request_id: o.outputs[0].token_ids for step in outputs for o in step}
    assert [final[k] for k in sorted(final, key=int)] == plain
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_verifications > 0


def test_stop_token_max_tokens_and_max_model_len_truncate_accepted_runs(make_llm):
    prompt = _prompts(3)[1]
    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=6)
    plain_llm, llm = make_llm(max_model_len=40), make_llm(max_model_len=40, speculative=spec)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    want = plain_llm.generate([prompt], long)[0].outputs[0]
    got = llm.generate([prompt], long)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length"
    assert len(got.token_ids) == 40 - len(prompt)
    stop = want.token_ids[5]
    for params in (
        SamplingParams(max_tokens=100, temperature=0.0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ):
        want = plain_llm.generate([prompt], params)[0].outputs[0]
        got = llm.generate([prompt], params)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.finish_reason, want.stop_reason
        )
    assert llm.engine.stats().num_spec_accepted_tokens > 0


def test_logprobs_of_accepted_tokens_match_plain_decoding(make_llm):
    prompt = _prompts(4)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    want = make_llm().generate([prompt], params)[0].outputs[0]
    llm = make_llm(speculative=SpeculativeConfig(method="draft", draft_model="default"))
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]


def test_abort_mid_generation_frees_target_and_draft_blocks(make_llm):
    llm = make_llm(block_size=4, speculative=SpeculativeConfig(method="draft", draft_model="default"))
    stream = llm.stream(_prompts(5)[:3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        next(stream)
    draft_pool = llm.engine.proposer.pool  # type: ignore[union-attr]
    assert draft_pool.num_held_blocks > 0
    assert llm.engine.abort_request("1") is True
    llm.engine.check_integrity()
    stream.close()
    assert draft_pool.num_held_blocks == 0 and llm.engine.pool.num_held_blocks == 0


SEEDED = [SamplingParams(max_tokens=20, temperature=1.0, seed=200 + i, ignore_eos=True) for i in range(4)]


def test_seeded_sampling_with_speculation_gives_the_tokens_without(make_llm, method, other_draft):
    prompts = _prompts(6)
    plain = _tokens(make_llm().generate(prompts, SEEDED))
    llm = make_llm(speculative=_speculative(method, other_draft))
    assert _tokens(llm.generate(prompts, SEEDED)) == plain
    assert llm.engine.stats().num_spec_verifications > 0
    # Moved onto a speculating worker after 7 tokens (as router/dispatch.py continues it): the same.
    params = SEEDED[0].model_copy(update={"max_tokens": SEEDED[0].max_tokens - 7})
    llm.engine.add_request("moved", prompts[0] + plain[0][:7], params, num_prior_output_tokens=7)
    moved = list(plain[0][:7])
    while llm.engine.has_unfinished():
        moved += [t for out in llm.engine.step() for t in out.new_token_ids]
    assert moved == plain[0]


def test_a_seeded_draft_model_races_with_the_target_s_draws(make_llm):
    """The target as its own draft: drawing with the same noise for the same output position, its
    drafts are the target's tokens, so (nearly: logits differ by rounding) all are accepted."""
    llm = make_llm(speculative=SpeculativeConfig(method="draft", draft_model="default"))
    llm.generate(_prompts(6), SEEDED)
    stats = llm.engine.stats()
    assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_draft_tokens > 0


def test_no_speculation_above_the_batch_size_limit(make_llm):
    prompts = _prompts(7)
    for limit, expect_spec in ((3, False), (4, True)):
        spec = SpeculativeConfig(method="draft", draft_model="default", disable_above_batch_size=limit)
        llm = make_llm(speculative=spec)
        llm.generate(prompts, GREEDY)  # four requests run together to the end
        assert (llm.engine.stats().num_spec_verifications > 0) == expect_spec


def test_adaptive_draft_length_follows_acceptance():
    config = SpeculativeConfig(method="ngram", num_draft_tokens=8, min_draft_gain=0.2)
    request = Request("r", [1, 2], SamplingParams(), arrival_time=0.0)
    assert adaptive.num_draft_tokens(config, request) == 4  # the prior: 0.7 ** 4 >= 0.2 > 0.7 ** 5
    for _ in range(20):
        adaptive.observe(request, num_drafted=4, num_accepted=4)
    assert adaptive.num_draft_tokens(config, request) == 8
    for _ in range(20):
        adaptive.observe(request, num_drafted=4, num_accepted=0)
    assert adaptive.num_draft_tokens(config, request) == 1
    fixed = config.model_copy(update={"enable_adaptive_draft_length": False})
    assert adaptive.num_draft_tokens(fixed, request) == 8


def test_adaptive_draft_length_drafts_less_for_a_poor_draft(make_llm, other_draft):
    spec = SpeculativeConfig(method="draft", draft_model=str(other_draft), num_draft_tokens=6)
    llm = make_llm(speculative=spec)
    llm.generate(_prompts(8), GREEDY)
    stats = llm.engine.stats()
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens / 4  # a random draft, rarely right
    assert stats.num_spec_draft_tokens / stats.num_spec_verifications < 3


def test_ngram_lookup():
    assert lookup([1, 2, 3, 4, 1, 2], 1, 3, 5) == [3, 4, 1, 2]
    assert lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 1, 2, 2) == [7, 2]  # the latest earlier occurrence
    assert lookup([5, 6, 7], 1, 3, 2) == []
    assert lookup([7, 7], 1, 3, 4) == [7]
    # A byte match straddling two token ids is not a token match.
    assert lookup([256, 1, 0, 1], 1, 1, 2) == [0, 1]
    assert lookup([1 << 8, 0, 1], 1, 1, 2) == []


def test_speculative_config_is_checked(make_llm, tmp_path):
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}'
    )
    with pytest.raises(ValueError, match="vocab_size 100"):
        make_llm(load_format="dummy", speculative=SpeculativeConfig(method="draft", draft_model=str(tmp_path)))


def test_draft_state_for_a_finished_request_is_an_integrity_error(make_llm):
    llm = make_llm(speculative=SpeculativeConfig(method="draft", draft_model="default"))
    stream = llm.stream([_prompts(9)[0]], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        next(stream)
    proposer = llm.engine.proposer
    with pytest.raises(IntegrityError, match="no longer running"):
        proposer.check_integrity([])  # type: ignore[union-attr]
    stream.close()
