"""A prompt's later chunks attend to its earlier ones: the profile's attention cost of a (query, key)
pair, fitted from its prefill points, prices them, in a prompt computed alone (the disaggregated
prefill worker) and in a colocated replica's chunked steps."""

from __future__ import annotations

import pytest

from cluster.planner import Layout, Request, StepProfile, simulate

A, B, ALPHA = 3.0, 0.02, 2e-6  # ms, ms a token, ms a (query, key) pair


def quadratic(budget: int = 2048) -> StepProfile:
    """Prefill of L tokens alone takes A + B L + ALPHA L^2 / 2 at every measured L; decode is free."""
    lengths = (128, 512, 1024, 2048)
    return StepProfile(prefill_tokens=lengths, prefill_ms=tuple(A + B * n + ALPHA * n * n / 2 for n in lengths),
                       decode_batches=(1, 64), decode_contexts=(1, 8192), decode_ms=((0.0, 0.0), (0.0, 0.0)),
                       max_num_batched_tokens=budget)


def test_the_pair_cost_is_the_quadratic_term_of_the_prefill_points():
    p = quadratic()
    assert p.context_ms_per_pair == pytest.approx(ALPHA, rel=1e-6)
    assert p.prefill_chunk_ms(2048, 0) == pytest.approx(p.prefill_step_ms(2048))
    assert p.prefill_chunk_ms(1024, 3000) == pytest.approx(p.prefill_step_ms(1024) + ALPHA * 1024 * 3000)
    assert p.prefill_chunk_ms(0, 3000) == 0.0


def test_too_few_points_or_a_concave_fit_price_no_context():
    two = StepProfile(prefill_tokens=(100, 200), prefill_ms=(10.0, 30.0), decode_batches=(1,), decode_contexts=(1,),
                      decode_ms=((1.0,),))
    assert two.context_ms_per_pair == 0.0
    concave = StepProfile(prefill_tokens=(100, 200, 400), prefill_ms=(10.0, 15.0, 17.0), decode_batches=(1,),
                          decode_contexts=(1,), decode_ms=((1.0,),))
    assert concave.context_ms_per_pair == 0.0


def test_a_prompt_past_the_budget_costs_its_chunks_and_their_context():
    p = quadratic(budget=2048)
    one_chunk = A + B * 2048 + ALPHA * 2048 * 2048 / 2
    # two chunks of 2,048: the second attends to the first's 2,048 keys as well as its own
    assert p.prompt_ms(4096) == pytest.approx(2 * one_chunk + ALPHA * 2048 * 2048, rel=1e-6)
    # more than the linear extrapolation of the fresh-prompt curve, which omits that context
    assert p.prompt_ms(4096) > p.prefill_step_ms(4096)
    assert p.prompt_ms(1000) == pytest.approx(p.prefill_step_ms(1000))


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(0, 1)])
def test_a_lone_long_prompt_gets_its_first_token_after_its_chunks(layout):
    p = quadratic(budget=2048)
    (timing,) = simulate(layout, p, [Request(0.0, 4096, 1)])
    assert timing.ttft_s * 1e3 == pytest.approx(p.prompt_ms(4096), rel=1e-9)
