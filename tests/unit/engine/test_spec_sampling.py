"""Sampled output with speculation follows the target's distribution exactly.

Two levels: the rejection sampler alone (many rows of one verification, against p), and the
engine end to end on tiny random models with a 16-token vocabulary: many requests with a draft
model (a perturbed copy of the target: about 70% of its drafts are accepted, so both the
acceptances and the residual draws are exercised) and with n-gram drafts (point masses), unseeded
(rejection sampling) and seeded (drafts compared with the target's own draws). The joint
distribution of the 2nd and 3rd generated tokens (the first verified ones) is compared with the
target's own, computed from its logits, by a chi-square test. Seeds make every run the same, so
the tests do not flake.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams, SpeculativeConfig
from engine.models import build_model
from engine.runner import ForwardSeq
from engine.sampler import Sampler, SamplingRow, VerifyRow

VOCAB = 16
MIN_P_VALUE = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_tiny_checkpoint(out: Path, seed: int, std: float = 0.5, like: Path | None = None) -> Path:
    """A 1-layer Llama with a 16-token vocabulary and weights large enough for peaked next-token
    distributions; safetensors, so a draft beside it loads the same way. With `like`: that
    checkpoint's weights plus noise of `std` (a draft that is often, not always, right)."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )
    (out / "config.json").write_text(json.dumps(config))
    model, _ = build_model(out, torch.float32, torch.device("cpu"), "dummy", seed)
    base = dict(build_model(like, torch.float32, torch.device("cpu"))[0].named_parameters()) if like else {}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=generator) * std
                param.copy_(base[name] + noise if like else noise)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_checkpoint(root / "target", seed=0)
    return target, make_tiny_checkpoint(root / "draft", seed=1, std=0.1, like=target)


def chi_square_p_value(counts: dict[object, int], expected_probs: dict[object, float]) -> float:
    """Pearson's test of counts against probabilities; bins expecting fewer than 5 are pooled."""
    total = sum(counts.values())
    assert set(counts) <= {k for k, p in expected_probs.items() if p > 0}, "a sample of probability 0"
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, p in expected_probs.items():
        expected = p * total
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


# ---- the rejection sampler alone
@pytest.mark.parametrize("point_mass", [False, True])
def test_verify_output_follows_p_and_accepts_sum_of_min(point_mass):
    num_rows, generator = 20000, torch.Generator().manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    q = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])
    p = p_logits.softmax(-1)
    params = SamplingParams(temperature=1.0)
    drafts = torch.multinomial(q, num_rows, replacement=True, generator=generator).tolist()
    if point_mass:
        drafts = [1] * num_rows  # an n-gram guess: q is a point mass on token 1
    rows = [
        VerifyRow(SamplingRow(params, [0], []), [d], None if point_mass else q.unsqueeze(0)) for d in drafts
    ]
    logits = p_logits.repeat(2 * num_rows, 1)  # [rows * (K + 1), vocab]
    result = Sampler(eos_token_ids=[]).verify(logits, rows, generator)
    firsts = Counter(tokens[0] for tokens in result.token_ids)
    assert chi_square_p_value(firsts, dict(enumerate(p.tolist()))) > MIN_P_VALUE
    acceptance = sum(result.num_accepted) / num_rows
    expected = float(p[1]) if point_mass else float(torch.minimum(p, q).sum())
    assert acceptance == pytest.approx(expected, abs=0.015)
    # The bonus token after an acceptance follows p too.
    bonus = Counter(tokens[1] for tokens in result.token_ids if len(tokens) == 2)
    assert chi_square_p_value(bonus, dict(enumerate(p.tolist()))) > MIN_P_VALUE


def test_verify_greedy_accepts_the_argmax_prefix():
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = logits[1, 3] = logits[2, 4] = logits[3, 0] = 1.0  # argmax per position: 2, 3, 4, 0
    row = SamplingRow(SamplingParams(temperature=0.0), [1], [])
    sampler = Sampler(eos_token_ids=[])
    assert sampler.verify(logits, [VerifyRow(row, [2, 3, 4], None)], None).token_ids == [[2, 3, 4, 0]]
    result = sampler.verify(logits, [VerifyRow(row, [2, 1, 4], None)], None)
    assert result.token_ids == [[2, 3]] and result.num_accepted == [1]


def test_verify_seeded_gives_the_tokens_of_plain_sampling_whatever_was_drafted():
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, seed=11)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)) * 0.5  # one row per position
    sampler = Sampler(eos_token_ids=[])
    plain: list[int] = []  # plain sampling, one token a step, after 2 tokens generated on another worker
    for n in range(5):
        plain += sampler(logits[n : n + 1], [SamplingRow(params, [4, 5], plain, 2)]).token_ids
    row = SamplingRow(params, [4, 5], [], 2)
    wrong = [(t + 1) % VOCAB for t in plain]
    for drafts, num_accepted in [(plain[:4], 4), (plain[:2] + wrong[2:4], 2), (wrong[:4], 0), (plain[:1], 1)]:
        result = sampler.verify(logits[: len(drafts) + 1], [VerifyRow(row, drafts, None)], None)
        assert result.num_accepted == [num_accepted]
        assert result.token_ids == [plain[: num_accepted + 1]]


def test_verify_seeded_follows_p_and_accepts_a_point_mass_with_its_probability():
    num_rows = 20000
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    p = p_logits.softmax(-1)
    rows = [VerifyRow(SamplingRow(SamplingParams(temperature=1.0, seed=i), [0], []), [1], None)
            for i in range(num_rows)]
    result = Sampler(eos_token_ids=[]).verify(p_logits.repeat(2 * num_rows, 1), rows, None)
    firsts = Counter(tokens[0] for tokens in result.token_ids)
    assert chi_square_p_value(firsts, dict(enumerate(p.tolist()))) > MIN_P_VALUE
    assert sum(result.num_accepted) / num_rows == pytest.approx(float(p[1]), abs=0.015)
    bonus = Counter(tokens[1] for tokens in result.token_ids if len(tokens) == 2)
    assert chi_square_p_value(bonus, dict(enumerate(p.tolist()))) > MIN_P_VALUE


# ---- the engine end to end
def exact_joint(target: Path, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(2nd token, 3rd token) under the target and params, summed over the 1st, from its logits."""
    llm = LLM(str(target), device="cpu", block_size=4)
    engine = llm.engine
    sampler = Sampler(engine.arch.eos_token_ids)

    def dists(outputs: list[list[int]]) -> list[torch.Tensor]:
        seqs, blocks = [], []
        for out in outputs:
            tokens = prompt + out
            blocks.append(engine.pool.allocate(-(-len(tokens) // 4)))
            seqs.append(ForwardSeq(tokens, 0, blocks[-1], 1))
        logits = engine.runner.forward(seqs)
        for b in blocks:
            engine.pool.free(b)
        rows = [SamplingRow(params, prompt, out) for out in outputs]
        return list(sampler.sample_with_probs(logits, rows)[1])

    p1 = dists([[]])[0]
    p2 = dists([[a] for a in range(VOCAB)])
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = dict(zip(pairs, dists([list(ab) for ab in pairs])))
    joint = {(b, c): 0.0 for b, c in pairs}
    for a, b in pairs:
        for c in range(VOCAB):
            joint[(b, c)] += float(p1[a] * p2[a][b] * p3[(a, b)][c])
    return joint


PROMPT = [*range(2, VOCAB), 3, 4]  # every token but EOS (1) and BOS: n-gram lookup always finds the last one
PLAIN = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
PROCESSED = SamplingParams(
    max_tokens=4, temperature=0.8, top_k=10, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4,
    frequency_penalty=0.2, ignore_eos=True,
)


@pytest.mark.parametrize(
    ("method", "params", "num_samples", "is_seeded"),
    [
        ("draft", PLAIN, 4000, False), ("draft", PLAIN, 3000, True), ("ngram", PLAIN, 3000, True),
        ("draft", PROCESSED, 3000, False),
    ],
    ids=["draft", "draft-seeded", "ngram-seeded", "draft-processed"],
)
def test_sampled_tokens_follow_the_target_distribution(make_llm, tiny_pair, method, params, num_samples, is_seeded):
    """Unseeded requests go through rejection sampling (the engine's generator is seeded: the runs
    repeat); seeded ones through the comparison with the target's own keyed draws."""
    target, draft = tiny_pair
    if method == "draft":
        spec = SpeculativeConfig(method="draft", draft_model=str(draft), num_draft_tokens=2,
                                 disable_above_batch_size=None)  # NOTE: thousands run at once; draft anyway
    else:
        spec = SpeculativeConfig(method="ngram", num_draft_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2,
                                 disable_above_batch_size=None)
    llm = make_llm(str(target), block_size=4, max_num_seqs=512, speculative=spec)
    seeded = [params.model_copy(update={"seed": i if is_seeded else None}) for i in range(num_samples)]
    outputs = llm.generate([PROMPT] * num_samples, seeded)
    counts = Counter((o.outputs[0].token_ids[1], o.outputs[0].token_ids[2]) for o in outputs)
    stats = llm.engine.stats()
    # Drafts were verified for most requests, and both accepted and rejected.
    assert stats.num_spec_verifications > num_samples / 2
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert chi_square_p_value(counts, exact_joint(target, PROMPT, params)) > MIN_P_VALUE
