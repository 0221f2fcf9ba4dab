"""The fused draw (engine/sampling_kernels.py) on the CPU through Triton's interpreter: its tokens
follow softmax(logits / T) (chi-square), do not depend on the chunking of the vocabulary or on the
other rows, and tend to the argmax as T -> 0; and `Sampler(fused=True)` keeps every other kind of
row (greedy, seeded, truncated, penalized) as the unfused sampler gives it.

NOTE: the kernel's module is imported under TRITON_INTERPRET (tests/interpreted.py says how, and
why this skips otherwise).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import Sampler, SamplingRow
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)
from tests.unit.engine.test_spec_sampling import MIN_P_VALUE, chi_square_p_value

sampling_kernels = import_interpreted("engine.sampling_kernels", "_race_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")

EOS = 0


def _seeds(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("vocab", "temperature", "chunk", "block"), [(7, 0.7, 8, 8), (37, 1.5, 64, 64)])
def test_race_follows_softmax_over_temperature(vocab: int, temperature: float, chunk: int, block: int) -> None:
    num_draws = 1500  # one interpreted program a draw: about 7 ms each
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    tokens = sampling_kernels.race(
        logits.expand(num_draws, vocab), torch.full((num_draws,), temperature), _seeds(num_draws, 1), chunk, block
    )
    assert tokens.dtype == torch.long and tokens.shape == (num_draws,)
    counts: dict[object, int] = {}
    for t in tokens.tolist():
        counts[t] = counts.get(t, 0) + 1
    expected = torch.softmax(logits / temperature, dim=0)
    assert chi_square_p_value(counts, dict(enumerate(expected.tolist()))) > MIN_P_VALUE


def test_race_does_not_depend_on_chunks_or_other_rows() -> None:
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3))
    temperature, seeds = torch.full((rows,), 1.0), _seeds(rows, 2)
    coarse = sampling_kernels.race(logits, temperature, seeds, 64, 16)
    fine = sampling_kernels.race(logits, temperature, seeds, 8, 8)  # 7 chunks, the last one short
    assert torch.equal(coarse, fine)
    alone = [sampling_kernels.race(logits[i : i + 1], temperature[i : i + 1], seeds[i : i + 1], 8, 8).item()
             for i in range(rows)]
    assert alone == fine.tolist()
    # Other seeds draw other tokens: the noise is keyed by the row's seed.
    others = [sampling_kernels.race(logits, temperature, _seeds(rows, s), 8, 8).tolist() for s in range(3, 8)]
    assert any(o != fine.tolist() for o in others)


def test_race_tends_to_the_argmax_as_temperature_falls() -> None:
    vocab, rows = 40, 8
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    tokens = sampling_kernels.race(logits, torch.full((rows,), 1e-4), _seeds(rows, 5), 16, 8)
    assert torch.equal(tokens, logits.float().argmax(dim=1))


def _row(**params: object) -> SamplingRow:
    output = params.pop("output", ())
    return SamplingRow(SamplingParams(max_tokens=16, **params), [1, 2], list(output))  # type: ignore[arg-type]


def test_fused_sampler_keeps_the_other_rows_as_the_unfused_one_gives_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_kernels, "_CHUNK", 16)
    monkeypatch.setattr(sampling_kernels, "_BLOCK", 8)
    vocab = 24
    rows = [
        _row(temperature=0.0),
        _row(temperature=0.8),  # fused
        _row(temperature=0.8, seed=11),
        _row(temperature=0.8, top_k=3),
        _row(temperature=1.2),  # fused
        _row(temperature=0.9, seed=12, top_p=0.5),
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(6))
    fused = Sampler([EOS], fused=True)(logits, rows, torch.Generator().manual_seed(0)).token_ids
    plain = Sampler([EOS], fused=False)(logits, rows, torch.Generator().manual_seed(0)).token_ids
    assert fused[0] == plain[0] == int(logits[0].argmax())
    assert fused[2] == plain[2] and fused[5] == plain[5], "seeded rows draw by their own key on either path"
    top3 = set(logits[3].topk(3).indices.tolist())
    assert fused[3] in top3 and all(0 <= t < vocab for t in fused)


def test_fused_sampler_draws_from_the_penalized_logits() -> None:
    """Near zero temperature the draw is the argmax of what it is given: the penalized logits."""
    vocab = 20
    logits = torch.zeros(3, vocab)
    logits[:, 5], logits[:, 6] = 3.0, 2.5
    logits[2, EOS] = 30.0
    cold = {"temperature": 1e-3}
    rows = [_row(**cold), _row(**cold, output=(5,), presence_penalty=1.0), _row(**cold, min_tokens=3)]
    tokens = Sampler([EOS], fused=True)(logits, rows, torch.Generator().manual_seed(0)).token_ids
    assert tokens == [5, 6, 5], "presence lowers 5 below 6; min_tokens masks EOS"
