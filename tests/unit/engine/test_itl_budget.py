"""The inter-token latency budget (SchedulerConfig.itl_budget_ms): while requests decode, a step adds
only the prompt tokens the measured prefill rate fits in the room the decode step leaves; without
decoding requests, or before anything is measured, the token budget alone rules; and the output
is the same tokens."""

from __future__ import annotations

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt_tokens_per_step(llm: LLM, measured: bool) -> tuple[list[int], list[list[int]]]:
    engine = llm.engine
    engine.add_request("decoding", list(range(5, 25)), GREEDY)
    engine.step()  # its prompt: now it decodes
    if measured:
        engine.rates.decode_step_s, engine.rates.prefill_tokens_per_s = 0.010, 2_000.0  # room: 10 ms = 20 tokens
    engine.add_request("long", list(range(100, 300)), GREEDY)
    chunks, outputs = [], {"decoding": [], "long": []}
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.request.request_id == "long")
        return out

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    while engine.has_unfinished():
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
        if measured:  # NOTE: pinned: the steps' own measurements would move them
            engine.rates.decode_step_s, engine.rates.prefill_tokens_per_s = 0.010, 2_000.0
    return chunks, [outputs["decoding"], outputs["long"]]


def test_prompt_chunks_fit_the_room_the_decode_step_leaves(make_llm):
    capped = make_llm(num_blocks=64, block_size=8, itl_budget_ms=20.0)
    chunks, tokens = _prompt_tokens_per_step(capped, measured=True)
    assert chunks[:10] == [20] * 10 and set(chunks[10:]) == {1}  # 200 prompt tokens, 20 a step, then it decodes
    free, free_tokens = _prompt_tokens_per_step(make_llm(num_blocks=64, block_size=8), measured=True)
    assert free[0] == 200  # no budget: the whole prompt at once
    assert tokens == free_tokens


def test_before_anything_is_measured_the_token_budget_alone_rules(make_llm):
    chunks, _ = _prompt_tokens_per_step(make_llm(num_blocks=64, block_size=8, itl_budget_ms=20.0), measured=False)
    assert chunks[0] == 200


def test_the_budget_never_stops_a_prompt(make_llm):
    llm = make_llm(num_blocks=64, block_size=8, itl_budget_ms=5.0)  # less than the decode step: a block a step
    chunks, _ = _prompt_tokens_per_step(llm, measured=True)
    # a block a step while the other request decodes (its 12 tokens); once it is done, the rest at once
    assert chunks[:10] == [8] * 10 and sum(c for c in chunks if c > 1) == 200
