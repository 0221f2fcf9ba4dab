"""Batched sampling: one call turns a step's logits into one token per sequence.

Every row carries its own SamplingParams, so one batch mixes greedy and random rows, penalties,
truncations and seeds. The order of operations on float32 logits (vLLM's, which follows OpenAI):

1. min_tokens: while a sequence has fewer than min_tokens output tokens, its EOS ids and its
   stop_token_ids are -inf (EOS is masked even with ignore_eos).
2. penalties: repetition (tokens of the prompt and the output), then frequency and presence
   (tokens of the output).
3. greedy rows (temperature 0) take the argmax of the penalized logits.
4. the other rows: temperature, top-k, top-p, min-p, then one random draw.

Logprobs come from log_softmax of the RAW logits, before all of the above (vLLM v1's default).

Randomness: the draw is the exponential race, argmax(probs / E) with E ~ Exponential(1) i.i.d. per
token, which samples exactly from probs. A row whose request has a seed brings its own
torch.Generator and draws its E from it alone, so its token depends neither on the other rows of
the batch nor on their order. Greedy rows draw nothing.

This module does not know sequences, schedulers or tokenizers: the caller owns the token lists
and the generators, and decides what a sampled EOS or stop token means. The rejection sampler of
speculative decoding is not here yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import SamplingParams

__all__ = ["SampleResult", "Sampler", "SamplingRow"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    """One sequence's view at one sampling step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's own, when params.seed is set; owned and advanced by the caller's sequence.
    generator: torch.Generator | None


@dataclass(frozen=True)
class SampleResult:
    """One sampled token per row, with the logprobs the rows asked for."""

    token_ids: list[int]  # one per row
    logprobs: list[float | None]  # sampled token's logprob per row; None where params.logprobs is None
    # params.logprobs alternatives (token id, logprob), most likely first; None where not asked.
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row of a batch of logits, each row with its own SamplingParams."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None
    ) -> SampleResult:
        """logits: [num_rows, vocab] float (any float dtype, any device). generator: used for rows without their own."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows, vocab] with num_rows == len(rows) == {len(rows)}; "
                f"got shape {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor; got dtype {logits.dtype}")
        if not rows:
            return SampleResult(token_ids=[], logprobs=[], top_logprobs=[])

        # NOTE: every step below is out of place, so the caller's logits are never changed.
        raw = logits.float()  # [rows, vocab]
        penalized = _apply_min_tokens(raw, rows, self.eos_token_ids)  # [rows, vocab]
        penalized = _apply_penalties(penalized, rows)  # [rows, vocab]
        token_ids = penalized.argmax(dim=-1)  # [rows]; final for greedy rows

        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)  # [random]
            params = [rows[i].params for i in random_rows]
            probs = _truncated_probs(penalized.index_select(0, index), params)  # [random, vocab]
            generators = [rows[i].generator for i in random_rows]
            token_ids = token_ids.index_copy(0, index, _exponential_race(probs, generators, generator))

        logprobs, top_logprobs = _gather_logprobs(raw, token_ids, rows)
        return SampleResult(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs)


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """-inf on EOS and stop token ids of the rows still short of min_tokens. logits: [rows, vocab]."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        # Ids outside the vocabulary can never be sampled; they need no mask.
        banned = {t for t in itertools.chain(eos_token_ids, row.params.stop_token_ids) if 0 <= t < vocab_size}
        row_index.extend([i] * len(banned))
        token_index.extend(banned)
    if not row_index:
        return logits
    device = logits.device
    indices = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
    return logits.index_put(indices, torch.tensor(_NEG_INF, device=device))


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: [lists, vocab] float32. Ids outside the vocabulary are ignored."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)  # [lists]
    token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)  # [total]
    row_ids = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)  # [total]
    in_vocab = (token_ids >= 0) & (token_ids < vocab_size)  # [total]
    row_ids, token_ids = row_ids[in_vocab].to(device), token_ids[in_vocab].to(device)
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)  # [lists, vocab]
    ones = torch.ones(token_ids.shape[0], dtype=torch.float32, device=device)  # [total]
    return counts.index_put_((row_ids, token_ids), ones, accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, out of place. logits: [rows, vocab] float32.

    repetition_penalty r, over tokens seen in the prompt or the output: logit / r if logit > 0,
    else logit * r. Then, over tokens of the output: logit -= frequency_penalty * count
    + presence_penalty * (count > 0). Rows without penalties are returned unchanged.
    """
    penalized_rows = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalized_rows:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    params = [rows[i].params for i in penalized_rows]
    index = torch.tensor(penalized_rows, device=device)  # [pen]
    sub = logits.index_select(0, index)  # [pen, vocab]
    outputs = [rows[i].output_token_ids for i in penalized_rows]
    output_counts = _token_counts(outputs, vocab_size, device)  # [pen, vocab]
    in_output = output_counts > 0  # [pen, vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_token_ids for i in penalized_rows], vocab_size, device)
        seen = in_output | (prompt_counts > 0)  # [pen, vocab]
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)  # [pen, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)

    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)  # [pen, 1]
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)  # [pen, 1]
    sub = sub - frequency * output_counts - presence * in_output.float()
    return logits.index_copy(0, index, sub)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k, then outside its nucleus. logits: [n, vocab]; top_k, top_p: [n].

    top_k is in [1, vocab] (vocab keeps all). The nucleus is the smallest prefix of the sorted
    tokens whose probability reaches top_p; the most likely token is always kept.
    """
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab] each
    rank = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, vocab]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k.unsqueeze(1), _NEG_INF)

    sorted_probs = sorted_logits.softmax(dim=-1)  # [n, vocab]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]; 0 at rank 0, so rank 0 stays
    # NOTE: top_p == 1 must keep everything; rounding in the cumsum could otherwise drop the tail.
    outside_nucleus = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)  # [n, vocab]
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)  # back to vocabulary order


def _truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p: logits [n, vocab] -> probs [n, vocab], zero outside the kept set.

    The result is not renormalized after min-p: the exponential race only needs it up to a
    per-row factor.
    """
    device, vocab_size = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)  # [n, 1]
    logits = logits / temperature

    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params):
        top_k_t = torch.tensor(top_k, device=device)  # [n]
        top_p_t = torch.tensor([p.top_p for p in params], device=device)  # [n]
        logits = _apply_top_k_top_p(logits, top_k_t, top_p_t)

    probs = logits.softmax(dim=-1)  # [n, vocab]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)  # [n, 1]
        # The ratio to the top probability does not change with renormalization, so min-p after
        # top-k/top-p keeps the same tokens as min-p on the temperature-scaled distribution.
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], shared: torch.Generator | None
) -> torch.Tensor:
    """One token per row of probs [n, vocab] (unnormalized is fine) -> [n] int64.

    Rows with their own generator draw their noise from it alone; the others share `shared`
    (torch's default generator when None).
    """
    noise = torch.empty_like(probs)  # [n, vocab]
    shared_rows: list[int] = []
    for i, row_generator in enumerate(generators):
        if row_generator is None:
            shared_rows.append(i)
        else:
            noise[i].exponential_(generator=row_generator)  # [vocab]; a view, filled in place
    if len(shared_rows) == len(generators):
        noise.exponential_(generator=shared)
    elif shared_rows:
        index = torch.tensor(shared_rows, device=probs.device)  # [shared]
        shared_noise = torch.empty(len(shared_rows), probs.shape[1], device=probs.device).exponential_(generator=shared)
        noise.index_copy_(0, index, shared_noise)
    # A zero draw would turn probs 0 into 0/0; the smallest normal float keeps the race well defined.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """The sampled token's logprob and the top alternatives, from the raw logits [rows, vocab]."""
    logprobs: list[float | None] = [None] * len(rows)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(rows)
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asking:
        return logprobs, top_logprobs

    index = torch.tensor(asking, device=raw_logits.device)  # [asking]
    all_logprobs = torch.log_softmax(raw_logits.index_select(0, index), dim=-1)  # [asking, vocab]
    sampled = all_logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)  # [asking]
    num_top = min(max(rows[i].params.logprobs or 0 for i in asking), raw_logits.shape[1])
    top_values, top_ids = all_logprobs.topk(num_top, dim=-1)  # [asking, num_top] each, descending

    sampled_list = sampled.tolist()
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(asking):
        wanted = rows[i].params.logprobs or 0
        logprobs[i] = sampled_list[j]
        top_logprobs[i] = list(zip(top_ids_list[j][:wanted], top_values_list[j][:wanted], strict=True))
    return logprobs, top_logprobs
