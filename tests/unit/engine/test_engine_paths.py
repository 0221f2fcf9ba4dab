"""The engine's alternative paths give the plain path's tokens: KV-cached decoding vs full
recomputation, a prefix-cache hit, chunked prefill, preemption with recompute, and a moved
request's continuation."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(length)] for _ in range(count)]


def test_kv_cached_decoding_equals_full_recomputation(make_llm):
    prompt = _prompts(1, 40)[0]
    cached = make_llm(block_size=8).generate([prompt], GREEDY)[0].outputs[0].token_ids
    # Recompute: each token is the first token of a fresh request over the whole context,
    # with prefix caching off so nothing is reused.
    llm = make_llm(block_size=8, enable_prefix_caching=False)
    context = list(prompt)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(len(cached)):
        context.append(llm.generate([context], one)[0].outputs[0].token_ids[0])
    assert context[len(prompt):] == cached


def test_prefix_cache_hit_gives_same_tokens(make_llm):
    shared = _prompts(1, 50, seed=1)[0]
    prompts = [shared + tail for tail in _prompts(3, 7, seed=2)]
    plain = make_llm(block_size=8, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = make_llm(block_size=8)
    llm.generate([prompts[0]], GREEDY)  # warms the cache with the shared prefix
    hit = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in hit] == [o.outputs[0].token_ids for o in plain]
    # 57-token prompts: the warmed one reuses 7 blocks of 8 (its last token is recomputed), the others
    # share the 6 full blocks of the 50-token prefix.
    assert [o.num_cached_tokens for o in hit] == [56, 48, 48]


def test_whole_prompt_cached_still_computes_last_token(make_llm):
    prompt = _prompts(1, 32, seed=3)[0]  # exactly 4 full blocks
    llm = make_llm(block_size=8)
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 24  # the last block is recomputed to get logits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_chunked_prefill_gives_same_tokens(make_llm):
    prompts = _prompts(3, 90, seed=4)
    plain = make_llm(max_num_batched_tokens=512).generate(prompts, GREEDY)
    llm = make_llm(max_num_batched_tokens=32, enable_prefix_caching=False)
    steps = list(llm.stream(prompts, GREEDY))
    assert sum(1 for s in steps if not s) >= 2, "prompts of 90 tokens under a 32-token budget take several steps"
    outs = {}
    for step in steps:
        for o in step:
            outs[o.request_id] = o.outputs[0].token_ids
    assert [outs[k] for k in sorted(outs, key=int)] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_and_resumed_requests_give_same_tokens(make_llm, prefix_caching):
    prompts = _prompts(4, 20, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = make_llm(block_size=4).generate(prompts, params)
    # 4 requests of 60 tokens need 60 blocks of 4; 24 blocks force preemptions.
    llm = make_llm(block_size=4, num_blocks=24, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().num_preemptions > 0
    # each prompt counts once however often it is recomputed (the autoscaler's mean prompt length)
    assert llm.engine.stats().num_prompts_started == len(prompts)


def test_seeded_sampling_survives_preemption_and_batching(make_llm):
    prompts = _prompts(4, 20, seed=6)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    alone = [make_llm(block_size=4).generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    tight_llm = make_llm(block_size=4, num_blocks=20)
    tight = tight_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in tight] == alone
    assert tight_llm.engine.stats().num_preemptions > 0  # the tight cache did preempt and recompute


def continuation(prompt: list[int], params: SamplingParams, prior: list[int]) -> tuple[list[int], SamplingParams]:
    """What router/dispatch.py sends the next worker when a request moves after yielding `prior`:
    the prompt grows by those tokens, max_tokens and min_tokens shrink by their count (the engine
    is told that count: num_prior_output_tokens)."""
    n = len(prior)
    update = {"max_tokens": params.max_tokens - n, "min_tokens": max(0, params.min_tokens - n)}
    return prompt + prior, params.model_copy(update=update)


def _run(engine, request_id: str, prompt: list[int], params: SamplingParams, **options) -> list[int]:
    engine.add_request(request_id, prompt, params, **options)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == request_id for t in out.new_token_ids]
    return tokens


@pytest.mark.parametrize("num_prior", [3, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.1], ids=["greedy", "seeded"])
def test_continuation_keeps_frequency_and_presence_penalties(make_llm, num_prior, temperature):
    """Frequency and presence penalties count the request's whole output: a continuation carries the
    earlier attempt's outputs at the end of its prompt, and still gives the uninterrupted tokens."""
    prompt = [7] * 6 + _prompts(1, 10, seed=3)[0]
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, ignore_eos=True,
                            frequency_penalty=2.0, presence_penalty=1.5)
    want = make_llm(block_size=4).generate([prompt], params)[0].outputs[0].token_ids
    unpenalized = make_llm(block_size=4).generate(
        [prompt], params.model_copy(update={"frequency_penalty": 0.0, "presence_penalty": 0.0}))[0].outputs[0].token_ids
    assert unpenalized != want  # NOTE: the penalties matter on this prompt (the test would be moot else)
    engine = make_llm(block_size=4).engine
    moved_prompt, moved_params = continuation(prompt, params, want[:num_prior])
    got = _run(engine, "moved", moved_prompt, moved_params, num_prior_output_tokens=num_prior)
    assert want[:num_prior] + got == want


@pytest.mark.parametrize("num_prior", [1, 6])
def test_seeded_continuation_of_a_moved_request_gives_the_uninterrupted_tokens(make_llm, num_prior):
    prompt = _prompts(1, 20, seed=8)[0]
    params = SamplingParams(max_tokens=14, min_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    want = make_llm(block_size=4).generate([prompt], params)[0].outputs[0].token_ids
    engine = make_llm(block_size=4).engine
    moved_prompt, moved_params = continuation(prompt, params, want[:num_prior])
    engine.add_request("other", _prompts(1, 9, seed=9)[0], params.model_copy(update={"seed": 1}))  # a batch
    got = _run(engine, "moved", moved_prompt, moved_params, num_prior_output_tokens=num_prior)
    assert want[:num_prior] + got == want


def test_abort_mid_generation_frees_blocks(make_llm):
    llm = make_llm(block_size=4)
    stream = llm.stream(_prompts(3, 10, seed=7), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        next(stream)
    assert llm.engine.pool.num_held_blocks > 0
    assert llm.engine.abort_request("1") is True
    assert llm.engine.abort_request("1") is False  # idempotent
    stream.close()  # the generator aborts the rest
    assert llm.engine.pool.num_held_blocks == 0


def test_stop_token_and_max_model_len(make_llm):
    llm = make_llm(max_model_len=40)
    out = llm.generate([_prompts(1, 30)[0]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10
    first = out.outputs[0].token_ids[3]
    stopped = llm.generate([_prompts(1, 30)[0]], SamplingParams(max_tokens=100, temperature=0, stop_token_ids=[first]))
    assert stopped[0].outputs[0].token_ids == out.outputs[0].token_ids[: out.outputs[0].token_ids.index(first) + 1]
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == first
