"""The engine's disaggregation hooks without Ray or a transport: a prefill engine computes the
prompt and keeps its blocks (hold_kv), a decode engine reserves a lease, the KV is copied block by
block, and the decode engine continues: the tokens equal the colocated engine's, also for a
seeded request moved after some tokens (its continuation split the same way)."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def _disaggregated(
    prefill, decode, prompt: list[int], params: SamplingParams, rid: str, num_prior_output_tokens: int = 0
) -> list[int]:
    first_params = params.model_copy(update={"max_tokens": 1, "min_tokens": 0})
    prefill.add_request(rid, prompt, first_params, hold_kv=True, num_prior_output_tokens=num_prior_output_tokens)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (out,) = outs
    src_blocks = out.kv_block_ids
    assert src_blocks and prefill.held[rid] == src_blocks
    # the decode side's lease: prompt blocks plus room for the first decode step
    lease = decode.reserve(f"lease-{rid}", -(-(len(prompt) + 1) // decode.pool.block_size))
    num_prompt_blocks = -(-len(prompt) // prefill.pool.block_size)
    src = prefill.runner.kv_caches[:, :, src_blocks[:num_prompt_blocks]]  # [layers, 2, n, block, heads, dim]
    decode.runner.kv_caches[:, :, lease[:num_prompt_blocks]] = src
    prefill.release_held(rid)
    decode.add_prefilled(rid, prompt, out.new_token_ids[0], params, f"lease-{rid}", num_prior_output_tokens)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_split_prefill_and_decode_equal_colocated(make_llm, params):
    prompts = _prompts(4, seed=0)
    want = [o.outputs[0].token_ids for o in make_llm(block_size=8).generate(prompts, params)]
    prefill = make_llm(block_size=8).engine
    decode = make_llm(block_size=8).engine
    got = [_disaggregated(prefill, decode, p, params, str(i)) for i, p in enumerate(prompts)]
    assert got == want
    assert prefill.pool.num_cached_blocks > 0  # the pushed prompts stay in the prefill's prefix cache


def test_seeded_continuation_split_across_prefill_and_decode_gives_the_uninterrupted_tokens(make_llm):
    prompt = _prompts(1, seed=1)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=3, ignore_eos=True)
    want = make_llm(block_size=8).generate([prompt], params)[0].outputs[0].token_ids
    prefill, decode = make_llm(block_size=8).engine, make_llm(block_size=8).engine
    # As router/dispatch.py moves it after 5 tokens (test_engine_paths.continuation).
    moved_params = params.model_copy(update={"max_tokens": params.max_tokens - 5})
    assert want[:5] + _disaggregated(prefill, decode, prompt + want[:5], moved_params, "r#1", 5) == want


def test_held_kv_and_leases_count_in_integrity(make_llm):
    engine = make_llm(block_size=4, num_blocks=16).engine
    assert engine.reserve("lease-a", 5) is not None
    assert engine.reserve("lease-b", 20) is None  # cannot be had: nothing taken
    engine.check_integrity()
    assert engine.pool.num_held_blocks == 5
    with pytest.raises(ValueError, match="already holds"):
        engine.reserve("lease-a", 1)
    assert engine.release_held("lease-a") and not engine.release_held("lease-a")
    engine.add_request("r", [5] * 9, SamplingParams(max_tokens=1), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_held_blocks == 3 and "r" in engine.held
    engine.check_integrity()
    assert engine.abort_request("r")  # abort frees held KV too
    assert engine.pool.num_held_blocks == 0


def test_add_prefilled_rejects_a_short_lease(make_llm):
    engine = make_llm(block_size=4).engine
    engine.reserve("l", 1)
    with pytest.raises(ValueError, match="lease 'l' holds 1 blocks; the prompt needs 3"):
        engine.add_prefilled("r", [5] * 10, 7, SamplingParams(), "l")
    assert not engine.has_unfinished() and engine.pool.num_held_blocks == 1  # refused whole: the lease kept
    assert engine.release_held("l") and engine.pool.num_held_blocks == 0


def test_prefilled_requests_wait_for_room_in_the_batch(make_llm):
    """max_num_seqs bounds a decode worker's batch too: pushed requests past it wait, holding their
    blocks, and join as others finish; the tokens still equal the colocated engine's."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _prompts(5, seed=2)
    want = [o.outputs[0].token_ids for o in make_llm(block_size=8).generate(prompts, params)]
    prefill = make_llm(block_size=8).engine
    decode = make_llm(block_size=8, max_num_seqs=2).engine
    first: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        rid = str(i)
        prefill.add_request(rid, prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
        (out,) = [o for _ in range(8) if prefill.has_unfinished() for o in prefill.step()]
        lease = decode.reserve(f"lease-{rid}", -(-(len(prompt) + 1) // 8))
        num_prompt_blocks = -(-len(prompt) // 8)
        decode.runner.kv_caches[:, :, lease[:num_prompt_blocks]] = \
            prefill.runner.kv_caches[:, :, out.kv_block_ids[:num_prompt_blocks]]
        prefill.release_held(rid)
        decode.add_prefilled(rid, prompt, out.new_token_ids[0], params, f"lease-{rid}")
        first[rid] = out.new_token_ids[0]
    stats = decode.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 5)
    decode.check_integrity()  # the waiting requests' blocks count as held by them
    assert decode.abort_request("4")  # one that never ran: its blocks go back
    got = {rid: [tok] for rid, tok in first.items() if rid != "4"}
    batches = []
    for _ in range(100):
        if not decode.has_unfinished():
            break
        for o in decode.step():
            got[o.request_id] += o.new_token_ids
        batches.append(decode.stats().num_running)
    assert max(batches) == 2 and not decode.has_unfinished()
    assert [got[str(i)] for i in range(4)] == want[:4]
