"""The fused draw (engine/sampling_kernels.py) on the CPU through Triton's interpreter: its tokens
follow softmax(logits / T) (chi-square), do not depend on the chunking of the vocabulary or on the
other rows, and tend to the argmax as T -> 0; and `Sampler(fused=True)` keeps every other kind of
row (greedy, seeded, truncated, penalized) as the unfused sampler gives it. The fused verification
(`verify`, rejection sampling of drafts) emits the target's distribution (chi-square), handles the
edge cases (q = p, drafts of probability 0, point masses, rows of different K, temperature), and
`Sampler(fused=True).verify` takes it only when every row qualifies.

NOTE: the kernel's module is imported under TRITON_INTERPRET (tests/interpreted.py says how, and
why this skips otherwise).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.config import SamplingParams
from engine.draw_keys import _splitmix64, as_int64, draw_seed, seed_mix
from engine.sampler import Sampler, SamplingRow, VerifyRow
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)
from tests.unit.engine.test_spec_sampling import MIN_P_VALUE, chi_square_p_value

sampling_kernels = import_interpreted("engine.sampling_kernels", "_race_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")

EOS = 0


def draws(inv_temp: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`race`'s rows as RaceRows stages them: row r's (a, b, float64 bits of 1 / T); b = 0 by default."""
    b = torch.zeros_like(a) if b is None else b
    return torch.stack([a.long(), b.long(), inv_temp.double().view(torch.int64)], dim=1).reshape(-1)


def keys_of(a: torch.Tensor, b: torch.Tensor | None = None, step: int = 0) -> torch.Tensor:
    """The rows' keys the race computes: splitmix64(a ^ (b + step)), as int64 bits."""
    b = torch.zeros_like(a) if b is None else b
    return torch.tensor([as_int64(_splitmix64((x % (1 << 64)) ^ ((y + step) % (1 << 64))))
                         for x, y in zip(a.tolist(), b.tolist())])


def _seeds(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("vocab", "temperature", "chunk", "block"), [(7, 0.7, 8, 8), (37, 1.5, 64, 64)])
def test_race_follows_softmax_over_temperature(vocab: int, temperature: float, chunk: int, block: int) -> None:
    num_draws = 1500  # one interpreted program a draw: about 7 ms each
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    tokens = sampling_kernels.race(
        logits.expand(num_draws, vocab), draws(torch.full((num_draws,), 1 / temperature), _seeds(num_draws, 1)), 0,
        chunk, block,
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
    coarse = sampling_kernels.race(logits, draws(temperature, seeds), 0, 64, 16)
    fine = sampling_kernels.race(logits, draws(temperature, seeds), 0, 8, 8)  # 7 chunks, the last one short
    assert torch.equal(coarse, fine)
    alone = [
        sampling_kernels.race(logits[i : i + 1], draws(temperature[i : i + 1], seeds[i : i + 1]), 0, 8, 8).item()
        for i in range(rows)
    ]
    assert alone == fine.tolist()
    # Other seeds draw other tokens: the noise is keyed by the row's seed.
    others = [sampling_kernels.race(logits, draws(temperature, _seeds(rows, s)), 0, 8, 8).tolist()
              for s in range(3, 8)]
    assert any(o != fine.tolist() for o in others)


def test_one_launch_picks_each_row_s_token_across_its_chunks_and_leaves_the_counts_zeroed() -> None:
    """The last of a row's chunk programs picks its token: the argmax of the scores the noise gives
    (first index on a tie), a row of -inf logits the last id, a lone finite logit in the last chunk
    that token; the counts are zero after the launch, so the next one reusing them draws the same."""
    vocab, rows = 50, 4
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(12)) * 2
    logits[2] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 45] = 0.0
    inv_temp, seeds = torch.full((rows,), 0.8), _seeds(rows, 13)
    counts = sampling_kernels.race_counts(rows, torch.device("cpu"))
    tokens = sampling_kernels.race(logits, draws(inv_temp, seeds), 0, 8, 8, counts=counts)  # 7 chunks, last short
    assert torch.equal(counts, torch.zeros_like(counts))
    noise = sampling_kernels.keyed_noise(keys_of(seeds), vocab)
    expected = (logits * inv_temp[:, None] - noise.log()).argmax(dim=1)
    assert tokens[:2].tolist() == expected[:2].tolist() and tokens[2] == vocab - 1 and tokens[3] == 45
    assert torch.equal(sampling_kernels.race(logits, draws(inv_temp, seeds), 0, 8, 8, counts=counts), tokens)
    with pytest.raises(ValueError, match="counts holds 2 rows"):
        sampling_kernels.race(logits, draws(inv_temp, seeds), 0, 8, 8, counts=counts[:2])


def test_the_race_keys_rows_by_splitmix_of_a_xor_b_plus_step() -> None:
    """Each row's key is splitmix64(a ^ (b + step)), bit for bit as draw_keys computes it on the host
    (any other key draws other noise): a seeded row's a = seed_mix(seed) and b + step = its output
    position give draw_seed(seed, position); the same rows at another step draw with other keys."""
    vocab, rows, step = 50, 6, 1_000_003
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(21))
    seeds, positions = [3, 2**40 + 7, 0, 99, 2**63 + 5, 12], [0, 5, 17, 1 << 33, 2, 7]
    a = torch.tensor([as_int64(seed_mix(x)) for x in seeds])
    b = torch.tensor([p - step for p in positions])  # negative for most: b + step wraps as 64-bit keys do
    inv_temp = torch.full((rows,), 1.25)
    tokens = sampling_kernels.race(logits, draws(inv_temp, a, b), step, 8, 8)
    keys = torch.tensor([as_int64(draw_seed(x, p)) for x, p in zip(seeds, positions)])
    assert torch.equal(keys, keys_of(a, b, step))
    expected = (logits * 1.25 - sampling_kernels.keyed_noise(keys, vocab).log()).argmax(dim=1)
    assert tokens.tolist() == expected.tolist()
    later = [sampling_kernels.race(logits, draws(inv_temp, a, b), step + k, 8, 8).tolist() for k in range(1, 5)]
    assert any(t != tokens.tolist() for t in later)
    with pytest.raises(ValueError, match=r"draws must be \[3 \* rows\]"):
        sampling_kernels.race(logits, draws(inv_temp, a, b)[:-1], step)


def test_race_tends_to_the_argmax_as_temperature_falls() -> None:
    vocab, rows = 40, 8
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    tokens = sampling_kernels.race(logits, draws(torch.full((rows,), 1e4), _seeds(rows, 5)), 0, 16, 8)
    assert torch.equal(tokens, logits.float().argmax(dim=1))


def _row(**params: object) -> SamplingRow:
    output = params.pop("output", ())
    return SamplingRow(SamplingParams(max_tokens=16, **params), [1, 2], list(output))  # type: ignore[arg-type]


def test_fused_sampler_leaves_greedy_and_top_k_rows_to_their_own_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside rows the fused kernel draws, a greedy row is its argmax and a top-k row is drawn from its
    k best tokens only (over 30 generators: never outside them, and not always the same one)."""
    monkeypatch.setattr(sampling_kernels, "_CHUNK", 16)
    monkeypatch.setattr(sampling_kernels, "_BLOCK", 8)
    vocab = 24
    rows = [
        _row(temperature=0.0),
        _row(temperature=0.8),  # fused
        _row(temperature=0.8, top_k=3),
        _row(temperature=1.2),  # fused
    ]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(6))
    sampler = Sampler([EOS], fused=True)
    top3 = set(logits[2].topk(3).indices.tolist())
    top_k_draws = set()
    for seed in range(30):
        fused = sampler(logits, rows, torch.Generator().manual_seed(seed)).token_ids
        assert fused[0] == int(logits[0].argmax())
        assert all(0 <= t < vocab for t in fused)
        top_k_draws.add(fused[2])
    assert top_k_draws <= top3 and len(top_k_draws) >= 2, (top_k_draws, top3)


def test_greedy_rows_take_their_argmax_in_the_race_launch_and_draw_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy row is drawn by the race (1 / T = inf: its logit is its score, no noise): the lowest index
    of its maximum, across chunks and within one, as torch's argmax; a batch of greedy rows draws nothing
    from the generator, and greedy rows beside random ones take one launch with them."""
    monkeypatch.setattr(sampling_kernels, "_CHUNK", 16)
    monkeypatch.setattr(sampling_kernels, "_BLOCK", 8)
    launches = []
    race = sampling_kernels.race
    monkeypatch.setattr(sampling_kernels, "race", lambda logits, *a, **k: launches.append(len(logits)) or race(
        logits, *a, **k))
    vocab = 40  # three chunks of 16
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(8))
    logits[0, [33, 5]] = 9.0  # a tie across chunks: 5
    logits[1, [22, 20]] = 9.0  # a tie within a chunk and a block: 20
    logits[2, 39] = 9.0  # the last token
    sampler = Sampler([EOS], fused=True)
    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    greedy = [_row(temperature=0.0) for _ in range(3)]
    assert sampler(logits[:3], greedy, gen).token_ids == [5, 20, 39] == logits[:3].argmax(dim=1).tolist()
    assert torch.equal(gen.get_state(), state) and launches == [3]
    mixed = sampler(logits, [*greedy, _row(temperature=0.9)], gen).token_ids
    assert mixed[:3] == [5, 20, 39] and 0 <= mixed[3] < vocab and launches == [3, 4]


def _random_words(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 bitmask words, about a third of the tokens allowed; bits past
    vocab set (the kernel must ignore them)."""
    bits = torch.rand(rows, -(-vocab // 32) * 32, generator=torch.Generator().manual_seed(seed)) < 0.35
    bits[:, vocab:] = True
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    return ((bits.view(rows, -1, 32).long() * weights).sum(-1) - (bits.view(rows, -1, 32)[..., 31].long() << 32)).int()


def _allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    cols = torch.arange(vocab)
    return ((words[:, cols // 32] >> (cols % 32)) & 1).bool()


def test_race_with_a_grammar_s_words_draws_what_it_draws_from_masked_logits() -> None:
    """The words read in the race's own pass (a grammar's bitmask, row by row through word_rows, -1
    for a row without one) give the very tokens of the race over logits masked to -inf first, for
    rows of one allowed token too, and over short last chunks."""
    vocab, rows = 70, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(8)) * 3
    words = _random_words(4, vocab, 9)
    words[3] = 0
    words[3, 65 // 32] = 1 << (65 % 32)  # token 65 alone
    word_rows = torch.tensor([2, -1, 0, 3, 1, 2], dtype=torch.int32)
    temperature, seeds = torch.full((rows,), 1.3), _seeds(rows, 10)
    allowed = torch.ones(rows, vocab, dtype=torch.bool)
    allowed[word_rows >= 0] = _allowed(words, vocab)[word_rows[word_rows >= 0].long()]
    masked = logits.masked_fill(~allowed, float("-inf"))
    for chunk, block in ((64, 16), (8, 8)):
        fused = sampling_kernels.race(logits, draws(temperature, seeds), 0, chunk, block, words=words,
                                        word_rows=word_rows)
        assert torch.equal(fused, sampling_kernels.race(masked, draws(temperature, seeds), 0, chunk, block))
        assert all(allowed[r, t] for r, t in enumerate(fused.tolist()))
        assert fused[3] == 65
    unmasked = sampling_kernels.race(logits, draws(temperature, seeds), 0, 8, 8)
    assert fused[1] == unmasked[1], "a row without words draws as without a grammar"
    with pytest.raises(ValueError, match="word_rows"):
        sampling_kernels.race(logits, draws(temperature, seeds), 0, words=words, word_rows=word_rows[:3])


def test_fused_sampler_applies_a_grammar_mask_to_mixed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TokenMask over some rows of a batch of kernel rows and torch-path rows: every token is one
    its mask allows, and the kernel rows draw what the unfused race draws from masked logits."""
    from engine.grammar import TokenMask

    monkeypatch.setattr(sampling_kernels, "_CHUNK", 16)
    monkeypatch.setattr(sampling_kernels, "_BLOCK", 8)
    vocab = 40
    rows = [_row(temperature=0.9, seed=1), _row(temperature=0.8, top_k=5), _row(temperature=1.1, seed=2),
            _row(temperature=1.0, seed=3)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(11))
    mask = TokenMask(rows=[0, 1, 3], bitmask=_random_words(3, vocab, 12))
    allowed = _allowed(mask.bitmask, vocab)
    sampler = Sampler([EOS], fused=True)
    for batch in (rows, [rows[0], rows[2], rows[3], rows[0]]):  # mixed kinds, then kernel rows alone
        tokens = sampler.launch(logits, batch, torch.Generator().manual_seed(0), mask).token_ids.tolist()
        for k, row in enumerate(mask.rows):
            assert allowed[k, tokens[row]], (batch, row, tokens)
        plain = [r for r, row in enumerate(batch) if row.params.top_k <= 0]
        masked = logits.clone()
        masked[mask.rows] = masked[mask.rows].masked_fill(~allowed, float("-inf"))
        alone = [sampler(masked[r : r + 1], [batch[r]]).token_ids[0] for r in plain]
        assert [tokens[r] for r in plain] == alone


def test_seeded_rows_draw_the_same_noise_in_the_kernel_and_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded row without truncation is drawn by the race kernel; with top_k = vocab (no truncation,
    but not a row the kernel takes) by the torch path over `keyed_noise`: the same key (seed, output
    position), the same noise, so the same token, row by row, whatever else is in the batch."""
    monkeypatch.setattr(sampling_kernels, "_CHUNK", 16)
    monkeypatch.setattr(sampling_kernels, "_BLOCK", 8)
    vocab, num = 40, 24
    logits = torch.randn(num, vocab, generator=torch.Generator().manual_seed(7)) * 2
    outputs = [list(range(i % 5)) for i in range(num)]
    in_kernel = [_row(temperature=0.9, seed=100 + i, output=outputs[i]) for i in range(num)]
    on_torch_path = [_row(temperature=0.9, seed=100 + i, top_k=vocab, output=outputs[i]) for i in range(num)]
    sampler = Sampler([EOS], fused=True)
    a = sampler(logits, in_kernel, torch.Generator().manual_seed(0)).token_ids
    b = sampler(logits, on_torch_path, torch.Generator().manual_seed(1)).token_ids
    assert a == b
    mixed = [row if i % 2 else _row(temperature=0.7) for i, row in enumerate(in_kernel)]
    c = sampler(logits, mixed, torch.Generator().manual_seed(2)).token_ids
    assert c[1::2] == a[1::2], "a seeded row's token does not depend on the unseeded rows beside it"
    assert len(set(a)) > 5, "different seeds draw different tokens"


def test_keyed_noise_is_philox_4x32_10_as_curand_reads_it() -> None:
    """Random123's known answer for Philox4x32-10 at key 0, counter 0 (words 6627e8d5 e169c58d ...),
    mapped as curand_uniform does (x * 2**-32 + 2**-33) and through -log: element 0 is the first
    word of thread 0's first call, and with 4 threads element 4 is that call's second word."""
    import math

    def exponential(word: int) -> float:
        return -math.log(word * 2.0**-32 + 2.0**-33)

    key = torch.zeros(1, dtype=torch.long)
    wide = sampling_kernels.keyed_noise(key, 64, block=16, threads=64)
    narrow = sampling_kernels.keyed_noise(key, 16, block=16, threads=4)
    assert wide[0, 0].item() == pytest.approx(exponential(0x6627E8D5), rel=1e-6)
    assert narrow[0, 0].item() == pytest.approx(exponential(0x6627E8D5), rel=1e-6)
    assert narrow[0, 4].item() == pytest.approx(exponential(0xE169C58D), rel=1e-6)
    assert narrow[0, 8].item() == pytest.approx(exponential(0xBC57AC4C), rel=1e-6)
    assert narrow[0, 12].item() == pytest.approx(exponential(0x9B00DBD8), rel=1e-6)
    assert wide[0, 1].item() != wide[0, 0].item(), "thread 1 has its own counter"


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


# ---- the fused verification (rejection sampling of drafts, sampling_kernels.verify)
def _verify(logits: torch.Tensor, drafts: list[list[int]], probs: list[torch.Tensor | None],
            temperatures: list[float], seed: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """(accepted drafts, last token) per row, through the kernel at a block of 8 (several blocks a row)."""
    seeds = _seeds(len(drafts), seed)
    out = sampling_kernels.verify(logits, drafts, probs, temperatures, seeds, block=8, stats_block=4).tolist()
    return out[: len(drafts)], out[len(drafts) :]


def test_verify_emits_the_target_distribution() -> None:
    """K = 2 drafts from q against fixed target logits at the 3 positions: the first emitted token
    follows p_0, and after an accepted first draft the second follows p_1 whatever the first (the
    joint of the two is min(p_0, q_0) / its sum times p_1); after both, the bonus follows p_2."""
    num_rows = 800  # one interpreted program a row: about 20 ms each
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -20.0],
                      [-0.5, 1.5, 0.0, 1.0, 0.2, 0.0],
                      [0.0, -1.0, 1.0, 2.0, 0.0, 0.5]])  # fmt: skip
    q = torch.tensor([[0.05, 0.40, 0.30, 0.10, 0.10, 0.05], [0.30, 0.10, 0.20, 0.10, 0.20, 0.10]])
    x, temperature = x * 2, 1.6  # NOTE: far from 1, so that a missed temperature shows
    p = torch.softmax(x / temperature, dim=-1)
    generator = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[k], num_rows, replacement=True, generator=generator) for k in (0, 1)])
    drafts_list = drafts.t().tolist()
    accepted, last = _verify(x.repeat(num_rows, 1), drafts_list, [q] * num_rows, [temperature] * num_rows, 1)
    emitted = [[*d[:m], t] for d, m, t in zip(drafts_list, accepted, last, strict=True)]
    assert all(0 <= m <= 2 for m in accepted)

    assert chi_square_p_value(Counter(e[0] for e in emitted), dict(enumerate(p[0].tolist()))) > MIN_P_VALUE
    kept = torch.minimum(p[0], q[0])
    acceptance = sum(m >= 1 for m in accepted) / num_rows
    assert acceptance == pytest.approx(float(kept.sum()), abs=0.06)  # about 3.5 standard deviations
    joint = {(a, b): float(kept[a] / kept.sum() * p[1, b]) for a in range(6) for b in range(6)}
    pairs = Counter((e[0], e[1]) for e in emitted if len(e) >= 2)
    assert chi_square_p_value(pairs, joint) > MIN_P_VALUE
    bonus = Counter(e[2] for e in emitted if len(e) == 3)
    assert sum(bonus.values()) > 100 and chi_square_p_value(bonus, dict(enumerate(p[2].tolist()))) > MIN_P_VALUE


def test_verify_accepts_every_draft_where_q_is_p_and_draws_the_bonus_from_p() -> None:
    vocab, k, num_rows = 10, 3, 12
    x = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(7))
    x[k] = float("-inf")
    x[k, 4], x[k, 7] = 1.0, 0.5  # the bonus position: only 4 or 7
    q = torch.softmax(x[:k], dim=-1)  # exactly the target's distributions, as float32 computes them
    drafts = torch.multinomial(q, num_rows, replacement=True, generator=torch.Generator().manual_seed(8)).t().tolist()
    accepted, last = _verify(x.repeat(num_rows, 1), drafts, [q] * num_rows, [1.0] * num_rows, 9)
    assert accepted == [k] * num_rows
    assert set(last) <= {4, 7}


def test_verify_rejects_a_draft_of_probability_zero_and_never_emits_it() -> None:
    vocab, num_rows = 8, 24
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(10))
    x[0, 5] = float("-inf")  # the target never takes 5 first
    q = torch.full((2, vocab), 1.0 / vocab)
    rows = [[5, 1]] * num_rows
    for probs in (q, None):  # a draft model's q, and a point mass
        accepted, last = _verify(x.repeat(num_rows, 1), rows, [probs] * num_rows, [1.0] * num_rows, 11)
        assert accepted == [0] * num_rows
        assert 5 not in last


def test_verify_point_masses_never_draw_a_rejected_draft_again() -> None:
    """An n-gram draft (q = one-hot): accepted with probability p(d); a rejection draws from p with d
    removed, and a draft of probability ~1 is always accepted."""
    vocab, num_rows = 6, 60
    x = torch.zeros(2, vocab)
    x[0, 2] = 1.0  # p(2) ~ 0.35 at the first position
    x[1, 0] = 30.0  # the bonus: 0
    accepted, last = _verify(x.repeat(num_rows, 1), [[2]] * num_rows, [None] * num_rows, [1.0] * num_rows, 12)
    assert 0 < sum(accepted) < num_rows
    assert all(t != 2 for m, t in zip(accepted, last, strict=True) if m == 0)
    assert all(t == 0 for m, t in zip(accepted, last, strict=True) if m == 1)
    x[0, 2] = 40.0  # p(2) ~ 1
    accepted, last = _verify(x.repeat(8, 1), [[2]] * 8, [None] * 8, [1.0] * 8, 13)
    assert accepted == [1] * 8 and last == [0] * 8


def test_verify_rows_of_different_k_in_one_launch_match_each_alone() -> None:
    """Rows of K = 1, 3 and 2, draft-model and point-mass rows mixed, two temperatures: each row's
    result is the one it gets alone with the same seed (the padding to K = 3 changes nothing)."""
    vocab = 12
    counts, temperatures = [1, 3, 2, 3], [1.0, 0.7, 1.3, 2.0]
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(sum(counts) + len(counts), vocab, generator=gen).to(torch.float16)
    probs = [torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1) for k in counts]
    probs[2] = None
    drafts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in counts]
    seeds = _seeds(len(counts), 15)
    together = sampling_kernels.verify(x, drafts, probs, temperatures, seeds, block=8, stats_block=4).tolist()
    starts = [0, 2, 6, 9, 13]
    for i in range(len(counts)):
        one = slice(i, i + 1)
        logits = x[starts[i] : starts[i + 1]]
        alone = sampling_kernels.verify(
            logits, drafts[one], probs[one], temperatures[one], seeds[one], block=8, stats_block=4
        ).tolist()
        assert alone == [together[i], together[len(counts) + i]]
        assert 0 <= alone[0] <= counts[i] and 0 <= alone[1] < vocab


def test_verify_divides_the_logits_by_the_temperature() -> None:
    """Near zero temperature p is the argmax: drafts equal to it are accepted, the first other one
    is rejected, and the last token is the argmax there. At T = 1 (p nearly uniform, as q) the other
    one is mostly accepted."""
    vocab, num_rows = 9, 16
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(16)) * 0.1  # nearly flat at T = 1
    best = x.argmax(dim=1).tolist()
    x[range(4), best] += 0.1  # a margin of 0.1 / T = 100 at T = 1e-3: p is one-hot
    wrong = (best[2] + 1) % vocab
    q = torch.full((3, vocab), 1.0 / vocab)
    rows = [[best[0], best[1], wrong]] * num_rows
    accepted, last = _verify(x.repeat(num_rows, 1), rows, [q] * num_rows, [1e-3] * num_rows, 17)
    assert accepted == [2] * num_rows and last == [best[2]] * num_rows
    accepted, _ = _verify(x.repeat(num_rows, 1), rows, [q] * num_rows, [1.0] * num_rows, 17)
    assert accepted.count(3) > num_rows / 2


def _verify_row(drafts: list[int], probs: torch.Tensor | None = None, **params: object) -> VerifyRow:
    output = params.pop("output", ())
    return VerifyRow(_row(output=output, **params), drafts, probs)


def test_fused_sampler_verifies_in_one_kernel_only_rows_that_qualify(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counting_verify(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_verify(*args, block=8, stats_block=8)  # type: ignore[arg-type]

    real_verify = sampling_kernels.verify
    monkeypatch.setattr(sampling_kernels, "verify", counting_verify)
    vocab = 10
    q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(18)), dim=-1)
    plain = [
        _verify_row([3, 4], q, temperature=0.9),
        _verify_row([1], None, temperature=1.2, min_tokens=2, output=(5, 6)),  # min_tokens met
        _verify_row([2, 2], None, temperature=0.7),
    ]
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(19))  # 3 + 2 + 3 positions
    result = Sampler([EOS], fused=True).verify(logits, plain, torch.Generator().manual_seed(20))
    assert calls == [1]
    assert result.logprobs == [None] * 3 and result.top_logprobs == [None] * 3
    for vr, tokens, m in zip(plain, result.token_ids, result.num_accepted, strict=True):
        assert 0 <= m <= len(vr.draft_token_ids)
        assert tokens[:-1] == list(vr.draft_token_ids[:m]) and 0 <= tokens[-1] < vocab
    # The seeds come from the generator: the same generator state gives the same tokens.
    seeds = torch.randint(0, 1 << 62, (3,), generator=torch.Generator().manual_seed(20))
    drafts, probs = [list(vr.draft_token_ids) for vr in plain], [vr.draft_probs for vr in plain]
    out = real_verify(logits, drafts, probs, [0.9, 1.2, 0.7], seeds, block=8, stats_block=8).tolist()
    assert result.num_accepted == out[:3] and [t[-1] for t in result.token_ids] == out[3:]

    others = [
        {"seed": 3}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2}, {"top_p": 0.9}, {"top_k": 3},
        {"min_p": 0.1}, {"logprobs": 2}, {"min_tokens": 5}, {"temperature": 0.0, "logprobs": 1},
    ]  # fmt: skip
    for params in others:
        rows = [*plain[:2], _verify_row([2, 2], None, **{"temperature": 0.7, **params})]
        result = Sampler([EOS], fused=True).verify(logits, rows, torch.Generator().manual_seed(20))
        assert calls == [1], f"{params} takes the torch path"
        assert [len(t) for t in result.token_ids] == [m + 1 for m in result.num_accepted]
    Sampler([EOS], fused=False).verify(logits, plain, torch.Generator().manual_seed(20))
    assert calls == [1], "an unfused sampler never takes the kernel"


def test_fused_greedy_verification_gives_the_torch_path_s_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows (alone, and beside random ones in one launch) take the kernel and give what the torch
    path gives: the drafts that are each position's argmax, then the argmax after them; a tie of maxima
    (one lane of the 8-entry blocks) goes to the lower index, as torch's argmax. A batch of greedy rows
    takes no seeds from the generator."""
    calls: list[int] = []
    real_verify = sampling_kernels.verify

    def counting_verify(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_verify(*args, block=8, stats_block=8)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling_kernels, "verify", counting_verify)
    vocab = 37
    logits = torch.randn(14, vocab, generator=torch.Generator().manual_seed(21)) * 2
    argmax = logits.argmax(dim=-1).tolist()
    logits[5, 3] = logits[5, 19] = logits[5].max() + 1.0  # a tie at position 5 (row 1's second): 3 wins
    argmax[5] = 3
    rows = [
        _verify_row([argmax[0], argmax[1], argmax[2]], None, temperature=0.0),  # all three accepted: the bonus
        _verify_row([argmax[4], 19, argmax[6]], None, temperature=0.0),  # rejected at the tie's loser
        _verify_row([(argmax[8] + 1) % vocab], None, temperature=0.0),  # rejected at once
        _verify_row([argmax[10], argmax[11], (argmax[12] + 1) % vocab], None, temperature=0.0),
    ]  # positions 0-3, 4-7, 8-9, 10-13
    fused = Sampler([EOS], fused=True).verify(logits, rows, None)
    torch_path = Sampler([EOS], fused=False).verify(logits, rows, None)
    assert calls == [1]
    assert fused.token_ids == torch_path.token_ids and fused.num_accepted == torch_path.num_accepted
    assert fused.num_accepted == [3, 1, 0, 2]
    assert fused.token_ids[0] == [*argmax[0:3], argmax[3]] and fused.token_ids[1] == [argmax[4], 3]
    generator = torch.Generator().manual_seed(5)
    Sampler([EOS], fused=True).verify(logits, rows, generator)
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())
    # Beside a random row, in the same launch: the greedy rows' tokens stay the same.
    mixed = [*rows[:2], _verify_row([1, 2], None, temperature=0.8), rows[3]]
    mixed_logits = torch.cat([logits[:8], torch.randn(3, vocab, generator=torch.Generator().manual_seed(22)),
                              logits[10:]])
    result = Sampler([EOS], fused=True).verify(mixed_logits, mixed, torch.Generator().manual_seed(23))
    assert calls == [1, 1, 1]
    assert [result.token_ids[i] for i in (0, 1, 3)] == [fused.token_ids[i] for i in (0, 1, 3)]


def test_fused_sampler_verification_rejects_bad_logits() -> None:
    rows = [_verify_row([3, 4], None, temperature=0.9)]
    with pytest.raises(ValueError, match="positions == 3"):
        Sampler([EOS], fused=True).verify(torch.zeros(4, 10), rows)
    with pytest.raises(ValueError, match=r"draft_probs\[0\] must be \[K, vocab\] = \[2, 10\]"):
        Sampler([EOS], fused=True).verify(torch.zeros(3, 10), [_verify_row([3, 4], torch.ones(2, 9) / 9)])


def test_verify_takes_drafts_on_the_device_as_it_takes_them_from_the_host() -> None:
    """Drafts passed as placeholders plus their place in a device tensor (draft_on_device) give
    the kernel the same inputs as the drafts themselves: the same results, seed for seed."""
    from engine.request import DeviceTokens

    vocab = 12
    counts, temperatures = [3, 1, 2], [1.0, 0.8, 1.2]
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(sum(counts) + len(counts), vocab, generator=gen)
    probs = [torch.softmax(torch.randn(k, vocab, generator=gen), dim=-1) for k in counts]
    drafts = [torch.randint(1, vocab, (k,), generator=gen).tolist() for k in counts]
    starts = [0, 4, 6]
    for start, d in zip(starts, drafts):  # the target all but certain of each draft: accepted (not 0)
        for j, token in enumerate(d):
            x[start + j, token] += 12.0
    # The flat device tensor holds them in another order, with other tokens between.
    flat = torch.randint(0, vocab, (16,), generator=gen)
    places = [[9, 2, 14], [0], [7, 3]]
    for d, where in zip(drafts, places):
        flat[where] = torch.tensor(d)
    seeds = _seeds(len(counts), 22)
    want = sampling_kernels.verify(x, drafts, probs, temperatures, seeds, block=8, stats_block=4).tolist()
    on_device = [DeviceTokens(flat, where) for where in places]
    on_device[1] = None  # a row whose drafts come from the host, beside them
    placeholders = [[0] * k if d is not None else drafts[i] for i, (k, d) in enumerate(zip(counts, on_device))]
    got = sampling_kernels.verify(
        x, placeholders, probs, temperatures, seeds, on_device, block=8, stats_block=4
    ).tolist()
    assert got == want
    wrong = sampling_kernels.verify(x, placeholders, probs, temperatures, seeds, block=8, stats_block=4).tolist()
    assert wrong != want, "the placeholders alone give other results (the check above can fail)"


def test_fused_speculative_steps_wait_for_the_drafts_only_after_verifying(make_llm, monkeypatch) -> None:
    """With the fused verification, a draft model's tokens stay on the device through the target's
    forward (patched into its inputs) and the verification kernel: the host reads them after
    queueing both. The tokens are those of the same run with every draft read as soon as drafted."""
    from engine import SpeculativeConfig
    from engine.spec import draft_model

    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompt = [5, 9, 14, 9, 5, 21, 30, 7]
    events: list[str] = []
    verify, read = sampling_kernels.verify, draft_model._DraftRead.read

    def recording_verify(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("verify" if any(d is not None for d in (args[5] if len(args) > 5 else [])) else "verify-host")
        return verify(*args, **kwargs)

    def recording_read(self):  # type: ignore[no-untyped-def]
        if not self.is_done:
            events.append("read")
        return read(self)

    monkeypatch.setattr(sampling_kernels, "verify", recording_verify)
    monkeypatch.setattr(draft_model._DraftRead, "read", recording_read)

    def run(read_at_once: bool) -> list[int]:
        llm = make_llm(speculative=SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=3))
        engine = llm.engine
        engine.sampler.fused = True  # NOTE: CUDA's sampler; its kernels run interpreted here
        engine.sampler._kernels = sampling_kernels
        if read_at_once:
            propose = engine.proposer.propose  # type: ignore[union-attr]

            def propose_and_read(*args):  # type: ignore[no-untyped-def]
                drafts = propose(*args)
                for d in drafts:
                    if d is not None:
                        d.token_ids  # noqa: B018 (the read)
                return drafts

            engine.proposer.propose = propose_and_read  # type: ignore[union-attr, method-assign]
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    deferred = run(read_at_once=False)
    deferred_events, events[:] = list(events), []
    at_once = run(read_at_once=True)
    assert deferred == at_once and len(deferred) == params.max_tokens
    # Every verification found its drafts unread (a read one is passed from the host: "verify-host").
    assert deferred_events.count("verify") >= 2 and "verify-host" not in deferred_events, deferred_events
    # and each draft was read after its verification was queued, never before
    assert deferred_events == ["verify", "read"] * deferred_events.count("verify"), deferred_events
    assert events.count("verify-host") >= 2 and "verify" not in events, events
