"""On a CUDA GPU (marked `gpu`): the fused draw (engine/sampling_kernels.py) compiled, at a real
vocabulary (151,936, the Qwen3 one: 19 chunks a row) and on a small one: its tokens follow
softmax(logits / T) (chi-square), tend to the argmax as T -> 0, and an engine that samples with it
matches one that does not in distribution on the same prompt."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import Sampler, SamplingRow
from tests.unit.engine.test_spec_sampling import MIN_P_VALUE, chi_square_p_value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EOS = 0


def _counts(tokens: list[int]) -> dict[object, int]:
    counts: dict[object, int] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0) + 1
    return counts


@pytest.mark.parametrize(("vocab", "temperature"), [(11, 0.7), (151_936, 1.3)])
def test_fused_draw_follows_softmax_over_temperature(vocab: int, temperature: float) -> None:
    from engine import sampling_kernels

    num_draws = 20_000 if vocab < 1000 else 4_096
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    if vocab < 1000:
        logits = torch.randn(vocab, device="cuda", generator=gen) * 2
    else:  # the mass on 10 tokens spread over the chunks, the rest far below (still drawable)
        logits = torch.full((vocab,), -30.0, device="cuda")
        top = torch.randperm(vocab, device="cuda", generator=gen)[:10]
        logits[top] = torch.randn(10, device="cuda", generator=gen) * 2
    seeds = torch.randint(0, 1 << 62, (num_draws,), device="cuda", generator=gen)
    tokens = sampling_kernels.race(logits.expand(num_draws, vocab), torch.full((num_draws,), temperature, device="cuda"),
                                   seeds)
    expected = torch.softmax(logits / temperature, dim=0)
    support = {i: p for i, p in enumerate(expected.tolist()) if p > 0}
    assert chi_square_p_value(_counts(tokens.tolist()), support) > MIN_P_VALUE


def test_fused_draw_tends_to_the_argmax_at_a_real_vocabulary() -> None:
    from engine import sampling_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151_936, device="cuda", generator=gen).to(torch.bfloat16)
    seeds = torch.randint(0, 1 << 62, (64,), device="cuda", generator=gen)
    tokens = sampling_kernels.race(logits, torch.full((64,), 1e-4, device="cuda"), seeds)
    # NOTE: bf16 rounds 151,936 normal draws onto few values near the top: a row's maximum is often
    # held by several tokens, any of which the race may pick. Each pick must hold its row's maximum.
    top = logits.float().max(dim=1).values
    assert torch.equal(logits.float().gather(1, tokens.unsqueeze(1)).squeeze(1), top)


def test_fused_and_unfused_samplers_agree_in_distribution() -> None:
    vocab, num_draws = 9, 8_000
    logits = torch.randn(1, vocab, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)).expand(
        num_draws, vocab
    )
    rows = [SamplingRow(SamplingParams(max_tokens=4, temperature=0.9, presence_penalty=0.5), [1], [4])] * num_draws
    expected_logits = logits[0].clone()
    expected_logits[4] -= 0.5
    expected = dict(enumerate(torch.softmax(expected_logits / 0.9, dim=0).tolist()))
    for fused in (True, False):
        tokens = Sampler([EOS], fused=fused)(logits, rows, torch.Generator(device="cuda").manual_seed(1)).token_ids
        assert chi_square_p_value(_counts(tokens), expected) > MIN_P_VALUE, f"fused={fused}"
