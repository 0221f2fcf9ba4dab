"""Unit tests of engine.sampler: greedy, truncations, penalties, min_tokens, seeds, distribution, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import Sampler, SamplingRow, _apply_penalties

EOS = 0


def _row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    num_prior_output_tokens: int = 0,
    **params: object,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt, output, num_prior_output_tokens)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draws(logits_row: list[float], num_draws: int, seed: int = 0, **params: object) -> list[int]:
    """num_draws samples of one distribution, as one batch drawing from a seeded shared generator."""
    logits = torch.tensor([logits_row]).repeat(num_draws, 1)  # [draws, vocab]
    rows = [_row(**params) for _ in range(num_draws)]
    return Sampler([EOS])(logits, rows, _seeded(seed)).token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50, generator=_seeded(1))
    result = Sampler([EOS])(logits, [_row(temperature=0.0)] * 4)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    # Low-precision input is accepted and gives the same choices.
    assert Sampler([EOS])(logits.to(torch.bfloat16), [_row(temperature=0.0)] * 4).token_ids == result.token_ids


def test_mixed_batch_truncations_to_one_token_equal_greedy() -> None:
    # Flat logits: a random draw lands on the argmax about 1 time in 32, so 30 repeats expose
    # any row that samples instead of truncating to the top token.
    logits = torch.randn(6, 32, generator=_seeded(2)) * 0.1  # [rows, vocab]
    argmax = logits.argmax(dim=-1).tolist()
    rows = [
        _row(temperature=0.0),
        _row(temperature=1.0, top_k=1),
        _row(temperature=1.0, top_p=1e-6),
        _row(temperature=1.0, min_p=1.0),
        _row(temperature=0.7, top_k=1, top_p=0.5, min_p=0.5),
        _row(temperature=1.0),
    ]
    generator = _seeded(3)
    free_tokens = set()
    for _ in range(30):
        tokens = Sampler([EOS])(logits, rows, generator).token_ids
        assert tokens[:5] == argmax[:5]
        free_tokens.add(tokens[5])
    assert len(free_tokens) > 5  # the unrestricted row really samples


def test_top_k_never_leaves_the_top_k() -> None:
    logits = torch.randn(20, generator=_seeded(4)).tolist()
    top_5 = set(torch.tensor(logits).topk(5).indices.tolist())
    counts = Counter(_draws(logits, 400, seed=5, top_k=5))
    assert set(counts) == top_5  # inside, and every one of them is reachable


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]).log().tolist()
    # Mass before token 1 is 0.5 < 0.75, before token 2 it is 0.8 >= 0.75: nucleus {0, 1}.
    counts = Counter(_draws(logits, 800, seed=6, top_p=0.75))
    assert set(counts) == {0, 1}
    assert counts[0] / 800 == pytest.approx(0.5 / 0.8, abs=0.06)  # renormalized inside the nucleus
    assert set(_draws(logits, 400, seed=7, top_p=0.85)) == {0, 1, 2}


def test_min_p_drops_tokens_below_the_fraction_of_the_top() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log().tolist()
    # Threshold 0.3 * 0.4 = 0.12: tokens 0, 1, 2 stay.
    assert set(_draws(logits, 500, seed=8, min_p=0.3)) == {0, 1, 2}


def test_penalties_change_exactly_the_expected_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5], [1.0, 2.0, -1.0, 3.0, 0.5]])  # [rows, vocab]
    rows = [
        _row(prompt=(1,), output=(2, 2, 3), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        _row(prompt=(1,), output=(2, 2, 3)),  # no penalties: unchanged
    ]
    penalized = _apply_penalties(logits, rows)
    # token 0 unseen; 1 in prompt only: 2 / 2; 2 twice in output: -1 * 2 - 0.5 * 2 - 0.25;
    # 3 once in output: 3 / 2 - 0.5 - 0.25; 4 unseen.
    expected = torch.tensor([[1.0, 1.0, -3.25, 0.75, 0.5], [1.0, 2.0, -1.0, 3.0, 0.5]])
    torch.testing.assert_close(penalized, expected)
    assert logits[0, 1] == 2.0  # the input is not modified


@pytest.mark.parametrize(
    ("logits_row", "row", "expected"),
    [
        ([2.0, 1.5], _row(prompt=(0,), repetition_penalty=2.0), 1),  # positive: divided
        ([-1.0, -1.5], _row(prompt=(0,), repetition_penalty=2.0), 1),  # negative: multiplied
        ([-1.0, -1.5], _row(output=(1,), repetition_penalty=2.0), 0),  # output tokens count too
        ([1.0, 0.9], _row(output=(0,), presence_penalty=0.5), 1),
        ([1.0, 0.9], _row(prompt=(0,), presence_penalty=0.5), 0),  # prompt tokens are not penalized
        ([1.0, 0.5], _row(output=(0, 0, 0), frequency_penalty=0.2), 1),  # 1 - 3 * 0.2 < 0.5
        ([1.0, 0.5], _row(output=(0,), frequency_penalty=0.2), 0),  # 1 - 0.2 > 0.5: counts matter
    ],
)
def test_penalty_flips_the_greedy_choice(logits_row: list[float], row: SamplingRow, expected: int) -> None:
    greedy_params = row.params.model_copy(update={"temperature": 0.0})
    greedy_row = SamplingRow(greedy_params, row.prompt_token_ids, row.output_token_ids)
    assert Sampler([EOS])(torch.tensor([logits_row]), [greedy_row]).token_ids == [expected]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0, 0.0, 4.0]])  # EOS best, then stop token 5, then 3
    sampler = Sampler([EOS])

    def greedy(num_output: int, **params: object) -> int:
        row = _row(output=(1,) * num_output, temperature=0.0, min_tokens=2, stop_token_ids=[5], **params)
        return sampler(logits, [row]).token_ids[0]

    assert greedy(1) == 3
    assert greedy(1, ignore_eos=True) == 3
    assert greedy(2) == EOS  # min_tokens reached: nothing is masked


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits_row = torch.randn(50, generator=_seeded(9)) * 0.3  # [vocab], flat enough to vary

    def run(batch_size: int, position: int, shared_seed: int) -> list[int]:
        tokens: list[int] = []
        for _ in range(6):
            rows = [_row(temperature=0.9, top_k=40) for _ in range(batch_size)]
            rows[position] = _row(output=tuple(tokens), temperature=0.9, top_k=40, seed=1234)
            logits = torch.randn(batch_size, 50, generator=_seeded(shared_seed))
            logits[position] = logits_row
            tokens.append(Sampler([EOS])(logits, rows, _seeded(shared_seed)).token_ids[position])
        return tokens

    reference = run(batch_size=1, position=0, shared_seed=0)
    assert len(set(reference)) > 1  # each output position draws anew
    assert run(batch_size=4, position=2, shared_seed=1) == reference
    assert run(batch_size=3, position=0, shared_seed=2) == reference


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 50)

    def tokens(seed: int) -> list[int]:
        return [Sampler([EOS])(logits, [_row(output=(5,) * n, seed=seed)]).token_ids[0] for n in range(10)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_a_seeded_draw_depends_on_the_seed_and_the_output_position_alone() -> None:
    logits = torch.randn(1, 50, generator=_seeded(13)) * 0.3  # [1, vocab]

    def token(output: tuple[int, ...], num_prior_output_tokens: int = 0, prompt: tuple[int, ...] = (1,)) -> int:
        row = _row(prompt, output, num_prior_output_tokens, temperature=1.0, seed=77)
        return Sampler([EOS])(logits, [row]).token_ids[0]

    tokens = [token((9,) * n) for n in range(12)]
    assert len(set(tokens)) > 1
    # A moved request's continuation: its earlier output ends its prompt, and is counted as prior.
    assert [token((), n, prompt=(1,) + (9,) * n) for n in range(12)] == tokens
    assert [token((9,) * (n - 3), 3) for n in range(3, 12)] == tokens[3:]


def test_seeded_draws_follow_the_distribution_across_seeds_and_positions() -> None:
    logits_row = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    rows = [_row(output=(3,) * (i % 7), seed=i // 7, temperature=1.0) for i in range(2100)]
    tokens = Sampler([EOS])(torch.tensor([logits_row]).repeat(len(rows), 1), rows).token_ids
    expected = torch.tensor(logits_row).softmax(dim=-1) * len(rows)
    chi_square = sum((Counter(tokens)[i] - e) ** 2 / e for i, e in enumerate(expected.tolist()))
    assert chi_square < 25.0  # 5 degrees of freedom: P(chi2 > 25) is about 1e-4


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_distribution_matches_softmax(temperature: float) -> None:
    logits_row = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    num_draws = 2000
    counts = Counter(_draws(logits_row, num_draws, seed=10, temperature=temperature))
    expected = (torch.tensor(logits_row) / temperature).softmax(dim=-1) * num_draws
    chi_square = sum((counts[i] - e) ** 2 / e for i, e in enumerate(expected.tolist()))
    assert chi_square < 25.0  # 5 degrees of freedom: P(chi2 > 25) is about 1e-4


def test_logprobs_come_from_raw_logits() -> None:
    logits = torch.randn(5, 30, generator=_seeded(11))  # [rows, vocab]
    raw_top = int(logits[4].argmax())
    rows = [
        _row(prompt=(1, 2, 3), temperature=0.5, repetition_penalty=3.0, presence_penalty=1.0, output=(4,), logprobs=3),
        _row(logprobs=None),
        _row(temperature=0.0, logprobs=0),
        _row(temperature=0.0, top_k=2, logprobs=5),
        # The penalty moves the choice off the raw top token: its logprob is not the top one.
        _row(prompt=(raw_top,), temperature=0.0, repetition_penalty=10.0, logprobs=2),
    ]
    result = Sampler([EOS])(logits.to(torch.bfloat16), rows, _seeded(12))
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)  # [rows, vocab]
    assert result.token_ids[4] != raw_top
    for i, wanted in [(0, 3), (2, 0), (3, 5), (4, 2)]:
        token = result.token_ids[i]
        assert result.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)
        top = result.top_logprobs[i]
        assert top is not None and len(top) == wanted
        assert [t for t, _ in top] == raw[i].topk(wanted).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(raw[i].topk(wanted).values.tolist(), abs=1e-6)
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert result.logprobs[1] is None and result.top_logprobs[1] is None
    assert math.isfinite(result.logprobs[0] or -math.inf)


def test_rejects_logits_that_do_not_match_the_rows() -> None:
    with pytest.raises(ValueError, match="num_rows"):
        Sampler([EOS])(torch.zeros(2, 5), [_row()])
    assert Sampler([EOS])(torch.zeros(0, 5), []).token_ids == []
