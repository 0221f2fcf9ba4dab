"""On a CUDA GPU (marked `gpu`): the fused draw (engine/sampling_kernels.py) compiled, at a real
vocabulary (151,936, the Qwen3 one: 19 chunks a row) and on a small one: its tokens follow
softmax(logits / T) (chi-square), tend to the argmax as T -> 0, and an engine that samples with it
matches one that does not in distribution on the same prompt. The fused verification of drafts
(`Sampler(fused=True).verify`) emits the target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.sampler import Sampler, SamplingRow, VerifyRow
from tests.unit.engine.test_spec_sampling import MIN_P_VALUE, chi_square_p_value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EOS = 0


def _draws(a: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """`race`'s rows (engine/draw_keys.py's RaceRows layout): these a, b = 0, one 1 / T."""
    temps = torch.full_like(a, 0, dtype=torch.float64).fill_(inv_temp).view(torch.int64)
    return torch.stack([a, torch.zeros_like(a), temps], dim=1).reshape(-1)


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
    tokens = sampling_kernels.race(
        logits.expand(num_draws, vocab), _draws(seeds, 1 / temperature), 0)
    expected = torch.softmax(logits / temperature, dim=0)
    support = {i: p for i, p in enumerate(expected.tolist()) if p > 0}
    assert chi_square_p_value(_counts(tokens.tolist()), support) > MIN_P_VALUE


def test_fused_draw_tends_to_the_argmax_at_a_real_vocabulary() -> None:
    from engine import sampling_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151_936, device="cuda", generator=gen).to(torch.bfloat16)
    seeds = torch.randint(0, 1 << 62, (64,), device="cuda", generator=gen)
    tokens = sampling_kernels.race(logits, _draws(seeds, 1e4), 0)
    # NOTE: bf16 rounds 151,936 normal draws onto few values near the top: a row's maximum is often
    # held by several tokens, any of which the race may pick. Each pick must hold its row's maximum.
    top = logits.float().max(dim=1).values
    assert torch.equal(logits.float().gather(1, tokens.unsqueeze(1)).squeeze(1), top)


def test_greedy_rows_of_the_race_are_torch_s_argmax_at_a_real_vocabulary() -> None:
    """1 / T = inf (a greedy row): the race's token is torch's argmax, bit for bit, ties (which bfloat16 makes
    common at this vocabulary) to the lowest index, at 1 row (16 chunks) and 64."""
    from engine import sampling_kernels

    gen = torch.Generator(device="cuda").manual_seed(3)
    for rows in (1, 64):
        logits = torch.randn(rows, 128_256, device="cuda", generator=gen).to(torch.bfloat16)
        seeds = torch.randint(0, 1 << 62, (rows,), device="cuda", generator=gen)
        tokens = sampling_kernels.race(logits, _draws(seeds, float("inf")), 0)
        assert torch.equal(tokens, logits.float().argmax(dim=1))


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


@pytest.mark.parametrize(("vocab", "point_mass"), [(11, False), (11, True), (5_000, False)])
def test_fused_verify_emits_the_target_distribution(
    vocab: int, point_mass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampler(fused=True).verify on CUDA, K = 3 drafts a row against fixed target logits at the 4
    positions: the first emitted token follows p_0, and after an accepted first draft the second
    follows p_1 whatever the first (their joint is min(p_0, q_0) / its sum times p_1). At the
    larger vocabulary the tokens outside the 8 likely ones are counted as one."""
    from engine import sampling_kernels

    num_rows, k, temperature = 20_000, 3, 0.8
    gen = torch.Generator(device="cuda").manual_seed(vocab + point_mass)
    x = torch.randn(k + 1, vocab, device="cuda", generator=gen) * 1.5
    if vocab > 1000:  # the mass on 8 tokens a position, the rest far below (still drawable), over several blocks
        likely = torch.randperm(vocab, device="cuda", generator=gen)[:8]
        x = torch.full((k + 1, vocab), -30.0, device="cuda").index_copy(1, likely, x[:, :8])
    p = torch.softmax(x / temperature, dim=-1)  # [K + 1, vocab]
    q = torch.softmax(x[:k] / temperature + torch.randn(k, vocab, device="cuda", generator=gen), dim=-1)
    if point_mass:  # an n-gram draft: always the first position's likeliest token
        guess = torch.full((k,), int(p[0].argmax()), dtype=torch.long, device="cuda")
        q = torch.nn.functional.one_hot(guess, vocab).float()
    drafts = torch.multinomial(q, num_rows, replacement=True, generator=gen).t().tolist()  # [rows, K]
    params = SamplingParams(max_tokens=8, temperature=temperature)
    rows = [VerifyRow(SamplingRow(params, [1], []), d, None if point_mass else q) for d in drafts]
    calls: list[int] = []
    real_verify = sampling_kernels.verify

    def counting_verify(*args: object) -> torch.Tensor:
        calls.append(1)
        return real_verify(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling_kernels, "verify", counting_verify)
    result = Sampler([EOS], fused=True).verify(x.repeat(num_rows, 1), rows, gen)
    assert calls == [1], "one launch of the fused kernel"
    assert all(t[:-1] == d[: len(t) - 1] for t, d in zip(result.token_ids, drafts, strict=True))

    keys = set(range(vocab)) if vocab < 1000 else set(likely.tolist())

    def binned(dist: torch.Tensor) -> dict[object, float]:  # the tokens outside keys as one, -1
        values = dist.tolist()
        out: dict[object, float] = {t: values[t] for t in keys}
        out[-1] = max(0.0, 1.0 - sum(out.values()))
        return out

    def key(t: int) -> int:
        return t if t in keys else -1

    p0, p1 = binned(p[0]), binned(p[1])
    accepted = binned(torch.minimum(p[0], q[0]) / torch.minimum(p[0], q[0]).sum())
    assert chi_square_p_value(_counts([key(t[0]) for t in result.token_ids]), p0) > MIN_P_VALUE
    joint: dict[object, float] = {(a, b): pa * pb for a, pa in accepted.items() for b, pb in p1.items()}
    pairs = _counts([(key(t[0]), key(t[1])) for t in result.token_ids if len(t) >= 2])  # type: ignore[misc]
    assert sum(pairs.values()) > num_rows / 10 and chi_square_p_value(pairs, joint) > MIN_P_VALUE


# ---- seeded rows: the kernels' noise is torch's CUDA generator's
@pytest.mark.parametrize("vocab", [8_192, 151_936, 600_000])
def test_keyed_noise_is_torch_cuda_exponential(vocab: int) -> None:
    """`keyed_noise` equals, bit for bit, what torch's `exponential_` writes from a generator seeded
    with the key (600,000 entries: more than torch's grid has threads, so threads draw several uniforms)."""
    from engine import sampling_kernels
    from engine.draw_keys import as_int64

    keys = [0, 1, 2**40 + 7, 2**63 + 5, 2**64 - 1]
    noise = sampling_kernels.keyed_noise(torch.tensor([as_int64(k) for k in keys], device="cuda"), vocab)
    for i, key in enumerate(keys):
        want = torch.empty(vocab, device="cuda").exponential_(generator=torch.Generator("cuda").manual_seed(key))
        differ = noise[i] != want
        assert not bool(differ.any()), f"key {key}: {int(differ.sum())} of {vocab} differ"


def test_seeded_tokens_of_the_kernel_are_the_torch_paths() -> None:
    """Sampler(fused=True) draws seeded rows (no truncation) in the race kernel; Sampler(fused=False)
    with a generator a row: the same tokens for the same (seed, output position), but where the two
    best scores are within rounding of each other (a near-tie)."""
    from engine import sampling_kernels
    from engine.draw_keys import as_int64
    from engine.sampler import _draw_key

    vocab, num = 151_936, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(num, vocab, device="cuda", generator=gen) * 3
    rows = [SamplingRow(SamplingParams(max_tokens=8, temperature=0.6 + (i % 5) * 0.2, seed=1000 + i),
                        [1, 2], [7] * (i % 9)) for i in range(num)]
    fused = Sampler([EOS], fused=True)(logits, rows).token_ids
    plain = Sampler([EOS], fused=False)(logits, rows).token_ids
    differ = [i for i in range(num) if fused[i] != plain[i]]
    assert len(differ) <= num // 100, f"rows {differ} differ"
    for i in differ:  # each a near-tie: the torch path's scores of the two tokens within 1e-5
        t = rows[i].params.temperature
        probs = torch.softmax(logits[i] / t, dim=0)
        key = torch.tensor([as_int64(_draw_key(rows[i]))], device="cuda")
        noise = sampling_kernels.keyed_noise(key, vocab)[0]
        a, b = float(probs[fused[i]] / noise[fused[i]]), float(probs[plain[i]] / noise[plain[i]])
        assert abs(a - b) <= 1e-5 * max(a, b), f"row {i}: {a} vs {b} is no near-tie"


def test_step_keys_advance_a_cuda_generator_on_the_host() -> None:
    """An unseeded fused draw's key comes from the CUDA generator's seed and offset (no kernel, no
    wait): the same seed gives the same key, each draw moves the offset on by one draw's 4, and two
    fused draws from one generator over the same logits differ (the second is not the first again)."""
    from engine.draw_keys import step_key

    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    keys = [step_key(gen, device) for _ in range(3)]
    assert gen.get_offset() == 12 and len(set(keys)) == 3
    assert step_key(torch.Generator(device="cuda").manual_seed(11), device) == keys[0]
    sampler = Sampler([EOS], fused=True)
    logits = torch.zeros(64, 1000, device="cuda")  # uniform rows: a repeated key would repeat all 64 tokens
    rows = [SamplingRow(SamplingParams(temperature=1.0, max_tokens=4), [1], []) for _ in range(64)]
    first = sampler(logits, rows, gen).token_ids
    second = sampler(logits, rows, gen).token_ids
    assert first != second
    assert len(set(first)) > 40  # rows keyed apart: not one token for all


def test_the_race_s_direct_launches_draw_as_its_first_and_split_by_alignment() -> None:
    """The race's second launch of a key calls its compiled variant directly (engine/direct_launch.py): it
    draws what the first drew for the same rows and step. A logits view 4 bytes off 16-byte alignment is
    another key (another variant, as Triton's launcher would pick): the same tokens as the aligned copy."""
    from engine import sampling_kernels

    vocab, rows = 8192, 8
    gen = torch.Generator(device="cuda").manual_seed(5)
    seeds = torch.randint(0, 1 << 62, (rows,), device="cuda", generator=gen)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen)
    first = sampling_kernels.race(logits, _draws(seeds, 1.0), 17)
    assert torch.equal(sampling_kernels.race(logits, _draws(seeds, 1.0), 17), first)
    assert not torch.equal(sampling_kernels.race(logits, _draws(seeds, 1.0), 18), first)
    shifted = torch.empty(rows * vocab + 1, device="cuda")[1:].view(rows, vocab)  # 4 bytes past alignment
    shifted.copy_(logits)
    assert shifted.data_ptr() % 16 == 4 and shifted.stride() == logits.stride()  # only the alignment differs
    for _ in range(2):
        assert torch.equal(sampling_kernels.race(shifted, _draws(seeds, 1.0), 17), first)
