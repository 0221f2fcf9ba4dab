"""The draft loop's one-launch draw (engine/spec/draft_draw.py) on the CPU, through the Triton
interpreter, against the torch ops it replaced: greedy and random rows, a vocabulary that is not a
multiple of the block, ties, and noise at 0."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

draw = import_interpreted("engine.spec.draft_draw", "_draft_draw_kernel")


def _reference(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
               noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    argmax = logits.argmax(dim=-1)
    tokens = torch.where(greedy, argmax, (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1))
    one_hot = torch.nn.functional.one_hot(argmax, logits.shape[1]).to(probs.dtype)
    return tokens, torch.where(greedy.unsqueeze(1), one_hot, probs)


@pytest.mark.parametrize("vocab", [37, 256])
def test_the_draw_gives_the_torch_ops_tokens_and_distributions(interpreted_triton, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[2, 5] = logits[2, 21] = logits[2].max() + 1.0  # a tie in one lane of 16: the lower index, as torch's argmax
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.5, 2.0])
    greedy = torch.tensor([True, False, True, False, False, True])
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    noise[3, 11] = 0.0  # clamped to float32's tiny, as the sampler's race: token 11 wins row 3
    tokens = torch.full((rows,), -1, dtype=torch.long)
    dists = torch.full((rows, vocab), -1.0)
    # NOTE: as the loop passes them: temperatures as float64, greedy flags as int64
    draw.draft_draw(logits, temperature.double(), greedy.long(), noise, tokens, dists, block=16)
    want_tokens, want_dists = _reference(logits, temperature, greedy, noise)
    assert tokens.tolist() == want_tokens.tolist()
    assert int(tokens[2]) == 5 and int(tokens[3]) == 11
    torch.testing.assert_close(dists, want_dists, atol=1e-6, rtol=1e-5)


def test_the_draw_names_a_mismatched_shape():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="tokens, temperature and greedy must be \\[2\\]"):
        draw.draft_draw(logits, torch.ones(3), torch.zeros(2, dtype=torch.bool), torch.ones(2, 8),
                   torch.zeros(2, dtype=torch.long), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="float32 alike"):
        draw.draft_draw(logits.half(), torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.ones(2, 8),
                   torch.zeros(2, dtype=torch.long), torch.zeros(2, 8))
