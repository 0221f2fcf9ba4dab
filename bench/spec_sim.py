"""Speculative decoding simulated exactly by full recomputation (no KV cache, batch 1, one prompt
at a time): what a drafter's acceptance is on real prompts, measured the same way for any drafter.

Per verification the drafter proposes K tokens with the distributions q_1..q_K they were drawn
from; the target scores the prefix and the drafts in one forward; drafts are kept while accepted
(T=0: the target's argmax; T>0: with probability min(1, p/q), the first rejection resampled from
norm(max(p - q, 0))), and a full acceptance earns the bonus token from p_{K+1}: the rule
engine/sampler.py verifies by. Lab only: the engine's own path is bench.spec_decode's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from bench.eagle_head import EagleHead
from bench.train_llama import TrainLlama


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., vocab] float32 probabilities; T=0: one-hot at the argmax."""
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class Drafter(Protocol):
    def propose(self, tokens: list[int], features: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        """K drafts after `tokens` and their distributions [K, vocab]. features: the target's hidden
        states [len(tokens) - 1, hidden] of every token but the last."""
        ...


class ModelDrafter:
    """A separate draft model of the target's tokenizer."""

    def __init__(self, model: TrainLlama) -> None:
        self.model = model

    def propose(self, tokens: list[int], features: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        device = features.device
        seq = list(tokens)
        qs = []
        for _ in range(k):
            q = distribution(self.model(torch.tensor([seq], device=device))[0, -1], temperature)
            seq.append(draw(q, generator))
            qs.append(q)
        return seq[len(tokens):], torch.stack(qs)


class HeadDrafter:
    """An EAGLE-style head: pairs (x_{j+1}, h_j), its own outputs in place of h past the prefix."""

    def __init__(self, head: EagleHead, target: TrainLlama) -> None:
        self.head, self.target = head, target

    def propose(self, tokens: list[int], features: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        device = features.device
        seq_tokens = list(tokens[1:])  # x_1 .. x_n beside h_0 .. h_{n-1}
        feats = self.head.features(features)
        drafts, qs = [], []
        for _ in range(k):
            f = self.head(torch.tensor([seq_tokens], device=device), feats[None])[0, -1]
            q = distribution(self.head.logits(f), temperature)
            d = draw(q, generator)
            drafts.append(d)
            qs.append(q)
            seq_tokens.append(d)
            feats = torch.cat((feats, f[None].to(feats.dtype)))
        return drafts, torch.stack(qs)


@dataclass
class SimCounts:
    num_verifications: int = 0
    num_drafted: int = 0
    num_accepted: int = 0  # drafts kept
    num_tested: int = 0  # drafts tested: a verification's first rejection ends its tests
    num_emitted: int = 0  # tokens appended by verifications (kept drafts + one each)

    def summary(self) -> dict[str, float | int]:
        return {
            "num_verifications": self.num_verifications,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "a_per_tested_draft": self.num_accepted / max(self.num_tested, 1),
            "accepted_per_drafted": self.num_accepted / max(self.num_drafted, 1),
            "tokens_per_verification": self.num_emitted / max(self.num_verifications, 1),
        }


def verify(p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor, temperature: float,
           generator: torch.Generator) -> tuple[int, int]:
    """p [K+1, vocab] the target's distributions, q [K, vocab]: (drafts kept, the token after them)."""
    for i, d in enumerate(drafts):
        if temperature == 0.0:
            if int(p[i].argmax()) == d:
                continue
            return i, int(p[i].argmax())
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[i, d]) < float(p[i, d]):  # u < p/q without dividing by a q of 0
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        return i, draw(residual / total if total > 0 else p[i], generator)
    bonus = p[len(drafts)]
    return len(drafts), (draw(bonus, generator) if temperature > 0 else int(bonus.argmax()))


@torch.no_grad()
def simulate(target: TrainLlama, drafter: Drafter, prompts: Sequence[Sequence[int]], k: int, temperature: float,
             max_tokens: int, seed: int) -> tuple[SimCounts, list[list[int]]]:
    """Speculative decoding of every prompt to max_tokens (the last verification may run past it;
    its surplus is cut). Returns the counts and each prompt's output tokens."""
    device = target.lm_head.weight.device
    counts = SimCounts()
    outputs = []
    for n, prompt in enumerate(prompts):
        generator = torch.Generator(device).manual_seed(seed + n)
        h = target.hidden(torch.tensor([list(prompt)], device=device))[0]
        tokens = list(prompt) + [draw(distribution(target.logits(h[-1]), temperature), generator)]
        features = h  # of every token but the last
        while len(tokens) - len(prompt) < max_tokens:
            drafts, q = drafter.propose(tokens, features, k, temperature, generator)
            h = target.hidden(torch.tensor([tokens + drafts], device=device))[0]
            p = distribution(target.logits(h[len(tokens) - 1 :]), temperature)  # [K+1, vocab]
            kept, after = verify(p, drafts, q, temperature, generator)
            counts.num_verifications += 1
            counts.num_drafted += len(drafts)
            counts.num_accepted += kept
            counts.num_tested += min(kept + 1, len(drafts))
            counts.num_emitted += kept + 1
            tokens += drafts[:kept] + [after]
            features = h[: len(tokens) - 1]
        outputs.append(tokens[len(prompt) : len(prompt) + max_tokens])
    return counts, outputs
