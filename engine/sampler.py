"""Batched sampling: one call turns a step's logits into one token per sequence.

Every row carries its own SamplingParams, so one batch mixes greedy and random rows, penalties,
truncations and seeds. The order of operations on float32 logits (vLLM's, which follows OpenAI):

0. a grammar (structured outputs): the tokens its row's TokenMask forbids are -inf
   (engine/grammar.py fills the mask; the caller passes it).
1. min_tokens: while a sequence has fewer than min_tokens output tokens, its EOS ids and its
   stop_token_ids are -inf (EOS is masked even with ignore_eos); not in a constrained row, whose
   grammar decides when it may end.
2. penalties: repetition (tokens of the prompt and the output), then frequency and presence
   (tokens of the output).
3. greedy rows (temperature 0) take the argmax of the penalized logits.
4. the other rows: temperature, top-k, top-p, min-p, then one random draw.

Logprobs come from log_softmax of the RAW logits, before all of the above (vLLM v1's default).

Randomness: the draw is the exponential race, argmax(probs / E) with E ~ Exponential(1) i.i.d. per
token, which samples exactly from probs. Rows without a seed share one generator (the caller's).
A seeded row's E for the token at output position n (counted over the request's whole output,
`SamplingRow.output_position`) is drawn from a generator seeded with `draw_seed(seed, n)` alone:
its token depends on (seed, n) and its distribution, never on the other rows, their order, how
many draws came before, or which worker drew them. A request moved to another worker, with the
tokens it had generated recomputed (`num_prior_output_tokens`), so continues the very stream of a
fault-free run. Greedy rows draw nothing. With `fused` (CUDA) the kernels compute those very noise
values themselves (engine/sampling_kernels.py), and a greedy row's argmax in the same launch.

Speculative decoding (Leviathan et al., 2023) adds two entry points:

- `sample_with_probs` (the draft's side) samples like `__call__` and also returns, per row, the
  distribution the token was drawn from (a one-hot row for greedy rows).
- `verify` (the target's side) takes the logits of the K+1 positions of each speculating row (its
  last token's, then each drafted token's) and returns the accepted drafts plus one token of the
  target's. Position i is processed exactly as a plain step would process it after the drafts
  d_1..d_i had been sampled (min_tokens, penalties over those tokens, temperature, top-k, top-p,
  min-p), so target and draft distributions see the same processing.

| rows     | verification                                         | what is exact                          |
|----------|------------------------------------------------------|----------------------------------------|
| greedy   | accept the longest prefix of drafts equal to the     | the tokens of plain greedy decoding    |
|          | target's argmax, then take the argmax                |                                        |
| seeded   | the same with the target's own race token at each    | the tokens of plain sampling with the  |
|          | position, argmax(p / E(seed, n)), for the argmax     | same seed, whatever was drafted, K, or |
|          |                                                      | the worker (so also the distribution)  |
| unseeded | rejection sampling: accept d_i with probability      | the distribution p (the tokens depend  |
|          | min(1, p(d_i) / q(d_i)) (u ~ U(0, 1) per draft); at  | on the shared generator's draws)       |
|          | the first rejection draw from max(0, p - q)          |                                        |
|          | renormalized, or from p after K acceptances          |                                        |

With `Sampler(fused=True)` (CUDA), a verification whose rows are all unseeded, untruncated, without
penalties or logprobs and past min_tokens runs their rejection sampling in one Triton
kernel (engine/sampling_kernels.py, `verify`) and one read.

"The tokens of" means: given the same logits; a verification step computes them in another batch
shape than a plain step, and a rounding difference can flip a near-tie, for seeded as for greedy
rows. q of an n-gram draft is a point mass. Seeded rows trade acceptance for reproducibility: a point
mass is accepted with probability p(d_i) either way; a draft model's token, raced with the same
E(seed, n) as the target's (`sample_with_probs` keys it by the same output position), equals the
target's with the probability of that coupling: at least (1 - TV) / (1 + TV) for TV the total
variation between q and p (Daliri et al., 2024), in practice a few points below the 1 - TV of
rejection sampling.

This module does not know sequences, schedulers or tokenizers: the caller owns the token lists
and the shared generator, and decides what a sampled EOS or stop token means.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.config import SamplingParams
from engine.draw_keys import RaceRows, as_int64, draw_seed
from engine.grammar import TokenMask, apply_token_mask, device_bitmask, mask_logits
from engine.pinned import Download, upload

if TYPE_CHECKING:
    from engine.request import DeviceTokens

__all__ = [
    "PendingSample",
    "SampleResult",
    "Sampler",
    "SamplingRow",
    "VerifyResult",
    "VerifyRow",
    "has_penalty",
]

_NEG_INF = float("-inf")
class SamplingRow(NamedTuple):  # NOTE: a NamedTuple (cheap to build): one a request a step
    """One sequence's view at one sampling step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Output tokens the request generated before output_token_ids, on an earlier worker: a moved
    # request's continuation carries them at the end of its prompt. Seeded draws count them.
    num_prior_output_tokens: int = 0

    @property
    def output_position(self) -> int:
        """Where the token this row samples stands in the request's whole output (0: the first)."""
        return self.num_prior_output_tokens + len(self.output_token_ids)


@dataclass(frozen=True)
class SampleResult:
    """One sampled token per row, with the logprobs the rows asked for."""

    token_ids: list[int]  # one per row
    logprobs: list[float | None]  # sampled token's logprob per row; None where params.logprobs is None
    # params.logprobs alternatives (token id, logprob), most likely first; None where not asked.
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(frozen=True)
class PendingSample:
    """A draw queued on the device and not yet read: `Sampler.launch`'s, for `Sampler.finish`."""

    raw: torch.Tensor  # [rows, vocab] float32: the logits, for logprobs
    token_ids: torch.Tensor  # [rows] int64 on the device
    rows: Sequence[SamplingRow]
    # NOTE: queued right behind the draw, so reading it waits for the draw alone, not for the next
    # step's forward queued since (a .tolist() of token_ids would wait for both).
    download: Download


@dataclass(frozen=True)
class VerifyRow:
    """One speculating sequence at a verification step."""

    row: SamplingRow  # the sequence before its drafted tokens
    draft_token_ids: Sequence[int]  # K >= 1
    # [K, vocab]: the distribution each drafted token was drawn from; None: point masses.
    draft_probs: torch.Tensor | None
    # The drafts still on the device (engine/request.py Draft): the fused verification takes them
    # from there; every other path reads draft_token_ids.
    draft_on_device: DeviceTokens | None = None


@dataclass(frozen=True)
class PendingVerify:
    """A fused verification queued on the device and not yet read (`Sampler.launch_verify`)."""

    out: torch.Tensor  # [2 * rows] int32 on the device: each row's accepted drafts, then its last token
    download: Download  # out's copy to the host, behind the verification alone
    rows: Sequence[VerifyRow]


@dataclass(frozen=True)
class VerifyResult:
    """Per row: the accepted drafted tokens, then one token of the target's (1 to K+1 tokens)."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # drafted tokens accepted, per row
    logprobs: list[list[float] | None]  # per emitted token; None where params.logprobs is None
    top_logprobs: list[list[list[tuple[int, float]]] | None]


class _Extended(Sequence[int]):
    """base + extra as one read-only sequence, without copying base (a row's output plus drafts)."""

    def __init__(self, base: Sequence[int], extra: Sequence[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        n = len(self.base)
        return self.base[index] if index < n else self.extra[index - n]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return itertools.chain(self.base, self.extra)


class Sampler:
    """Samples one token per row of a batch of logits, each row with its own SamplingParams.

    `fused` (CUDA): `__call__` draws the random rows without top-k, top-p or min-p in one Triton
    kernel (engine/sampling_kernels.py `race`): the same exponential race, a seeded row's noise the
    very values its torch generator would draw (so its tokens are the torch path's), an unseeded
    row's keyed by a random value drawn from the shared generator when the rows were staged and the
    launch's step (engine/draw_keys.py: the rows are uploaded only when they change). The torch path's
    seeded rows (truncated ones, `sample_with_probs`, a seeded verification) take their noise from one
    kernel for all rows (`keyed_noise`) rather than a generator a row. `verify` verifies in one kernel
    and one read when every row is unseeded, without truncation, penalties, logprobs or a min_tokens
    still to reach (`_verifies_fused`): the same rejection sampling, its uniforms and noise counted by
    (the row's seed, token id).
    """

    def __init__(self, eos_token_ids: Sequence[int], fused: bool = False) -> None:
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos_token_ids)
        self.fused = fused
        self._kernels: ModuleType | None = None  # engine.sampling_kernels, imported on the first fused draw
        self._race_counts: torch.Tensor | None = None  # the fused draw's counts (sampling_kernels.race_counts)
        self._race_rows: RaceRows | None = None  # the fused draw's rows on the device, uploaded when they change

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None,
        mask: TokenMask | None = None,
    ) -> SampleResult:
        """logits: [num_rows, vocab] float (any float dtype, any device). generator: shared by the rows
        without a seed (torch's default generator when None). mask: the constrained rows' allowed tokens."""
        return self.finish(self.launch(logits, rows, generator, mask))

    def finish(self, pending: PendingSample) -> SampleResult:
        """Reads a launched draw's tokens (the host waits for the device here) and its logprobs."""
        token_ids = pending.download.read()
        logprobs, top_logprobs = _gather_logprobs(pending.raw, pending.token_ids, pending.rows)
        return SampleResult(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)

    def launch(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None,
        mask: TokenMask | None = None,
    ) -> PendingSample:
        """`__call__` up to the tokens on the device, without reading them: with the fused draw and
        no rows that mix other kinds in, nothing here waits for the device."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows, vocab] with num_rows == len(rows) == {len(rows)}; "
                f"got shape {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor; got dtype {logits.dtype}")
        raw = logits.float()  # NOTE: raw stays unmasked: logprobs are of the raw logits
        device = logits.device
        words = None if mask is None else device_bitmask(mask, device)
        fused = [i for i, row in enumerate(rows) if _fusable(row.params)] if self.fused else []
        if fused and len(fused) == len(rows):
            token_ids = self._draw_fused(raw, rows, generator, _words(mask, words, fused, device))
        elif not fused:
            token_ids = self._draw(raw if mask is None else mask_logits(raw, mask.rows, words), rows, generator)
        else:  # NOTE: each kind on its own rows, then one token tensor in row order
            fused_set = set(fused)
            rest = [i for i in range(len(rows)) if i not in fused_set]
            fused_index, rest_index = upload(fused, torch.long, device), upload(rest, torch.long, device)
            token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
            token_ids.index_copy_(
                0, fused_index,
                self._draw_fused(raw.index_select(0, fused_index), [rows[i] for i in fused], generator,
                                 _words(mask, words, fused, device)),
            )
            masked = raw if mask is None else mask_logits(raw, mask.rows, words)
            token_ids.index_copy_(
                0, rest_index, self._draw(masked.index_select(0, rest_index), [rows[i] for i in rest], generator)
            )
        return PendingSample(raw, token_ids, rows, Download(token_ids))

    def _draw(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None
    ) -> torch.Tensor:
        """One token per row [rows] int64, on the torch path (any kind of row)."""
        _, token_ids, random_rows, probs = self._processed(logits, rows)
        if probs is None:
            return token_ids
        return self._race_into(token_ids, random_rows, probs, rows, generator)

    def _draw_fused(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None,
        words: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One token per row [rows] int64 from the fused kernel; every row `_fusable`. Penalties and
        min_tokens masks apply first, as on the torch path; a grammar's words in the kernel's pass."""
        device = logits.device
        penalized = _apply_penalties(_apply_min_tokens(logits, rows, self.eos_token_ids), rows)
        if self._race_rows is None or self._race_rows.device != device:
            self._race_rows = RaceRows(device)
        draws, step = self._race_rows.next([(row.params.seed, row.params.temperature, row.output_position)
                                            for row in rows], generator)
        bitmask, word_rows = words if words is not None else (None, None)
        kernels = self._kernel_module()
        if self._race_counts is None or self._race_counts.numel() < len(rows) or self._race_counts.device != device:
            self._race_counts = kernels.race_counts(max(len(rows), 256), device)
        return kernels.race(penalized, draws, step, words=bitmask, word_rows=word_rows, counts=self._race_counts)

    def _noise_kernels(self) -> ModuleType | None:
        """engine.sampling_kernels where seeded rows' noise comes from its kernel (fused), else None."""
        return self._kernel_module() if self.fused else None

    def _kernel_module(self) -> ModuleType:
        """engine.sampling_kernels, imported on first use."""
        if self._kernels is None:
            from engine import sampling_kernels  # NOTE: imports triton; only a fused draw needs it

            self._kernels = sampling_kernels
        return self._kernels

    def _processed(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """raw [n, vocab] float32, argmax of the penalized logits [n], the random rows, and their
        probabilities [random, vocab] as `__call__` races over them, not normalized (None when all
        rows are greedy). Every step is out of place: the caller's logits are never changed."""
        raw = logits.float()
        penalized = _apply_penalties(_apply_min_tokens(raw, rows, self.eos_token_ids), rows)  # [n, vocab]
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return raw, penalized.argmax(dim=-1), random_rows, None
        if len(random_rows) < len(rows):  # NOTE: all random (the common case): no row gather
            penalized_random = penalized.index_select(0, upload(random_rows, torch.long, logits.device))
        else:
            penalized_random = penalized
        probs = _truncated_probs(penalized_random, [rows[i].params for i in random_rows])
        return raw, penalized.argmax(dim=-1), random_rows, probs

    def _race_into(
        self,
        token_ids: torch.Tensor,
        random_rows: list[int],
        probs: torch.Tensor,
        rows: Sequence[SamplingRow],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """token_ids [n] with the random rows' entries replaced by their race over probs [random, vocab]."""
        raced = _exponential_race(probs, [_draw_key(rows[i]) for i in random_rows], generator, self._noise_kernels())
        if len(random_rows) == len(rows):
            return raced
        return token_ids.index_copy(0, upload(random_rows, torch.long, token_ids.device), raced)

    def sample_with_probs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """The draft's side: one token per row, and the distribution [rows, vocab] float32 it was
        drawn from (normalized; one-hot at the argmax for greedy rows)."""
        token_ids, dist = self.launch_with_probs(logits, rows, generator)
        return token_ids.tolist(), dist

    def launch_with_probs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_with_probs` without reading the tokens: [rows] int64 on the device; the host does
        not wait for the device (without penalties, whose counts are built on the host)."""
        _, token_ids, random_rows, probs = self._processed(logits, rows)
        dist = torch.nn.functional.one_hot(token_ids, logits.shape[1]).float()  # [rows, vocab]
        if probs is not None:
            token_ids = self._race_into(token_ids, random_rows, probs, rows, generator)
            normalized = probs / probs.sum(dim=-1, keepdim=True)
            if len(random_rows) == len(rows):
                dist = normalized
            else:
                dist = dist.index_copy(0, upload(random_rows, torch.long, logits.device), normalized)
        return token_ids, dist

    def verify(
        self, logits: torch.Tensor, rows: Sequence[VerifyRow], generator: torch.Generator | None = None,
        mask: TokenMask | None = None,
    ) -> VerifyResult:
        """The target's side: logits [sum of (K_i + 1), vocab], row i's K_i + 1 positions in a run.
        generator: shared by the rows without a seed. mask: by position (GrammarBook.mask_drafts): a
        drafted token the grammar forbids has probability 0 where it is verified, so it is rejected."""
        return self.finish_verify(self.launch_verify(logits, rows, generator, mask))

    def launch_verify(
        self, logits: torch.Tensor, rows: Sequence[VerifyRow], generator: torch.Generator | None = None,
        mask: TokenMask | None = None,
    ) -> PendingVerify | VerifyResult:
        """`verify` queued without a read where the fused kernel takes every row: a PendingVerify for
        `finish_verify` (the device work queued after it is not waited for there); otherwise the
        result, read already."""
        if self.fused and rows and all(_verifies_fused(vr) for vr in rows):
            # NOTE: unmasked logits go as they are (no float32 copy on the hot path)
            return self._launch_fused(logits if mask is None else apply_token_mask(logits.float(), mask), rows,
                                      generator)
        expanded: list[SamplingRow] = []  # one per position
        for vr in rows:
            drafts = list(vr.draft_token_ids)
            for i in range(len(drafts) + 1):
                output = _Extended(vr.row.output_token_ids, drafts[:i])
                expanded.append(
                    SamplingRow(vr.row.params, vr.row.prompt_token_ids, output, vr.row.num_prior_output_tokens)
                )
        if logits.dim() != 2 or logits.shape[0] != len(expanded):
            raise ValueError(
                f"logits must be [positions, vocab] with positions == {len(expanded)} (K + 1 per row); "
                f"got shape {tuple(logits.shape)}"
            )
        raw = logits.float()
        _, argmax, random_positions, probs = self._processed(apply_token_mask(raw, mask), expanded)
        starts = list(itertools.accumulate((len(vr.draft_token_ids) + 1 for vr in rows), initial=0))
        local = {pos: j for j, pos in enumerate(random_positions)}  # position -> row of probs
        # The target's own token at every position: the argmax for greedy rows, the keyed race for
        # seeded rows (what plain sampling draws there); unseeded rows' entries are unused.
        needs_chosen = any(vr.row.params.is_greedy or vr.row.params.seed is not None for vr in rows)
        chosen = argmax.tolist() if needs_chosen else []  # NOTE: a read (waits for the device) only when used
        seeded_positions = [pos for pos in random_positions if expanded[pos].params.seed is not None]
        if seeded_positions:
            assert probs is not None
            index = upload([local[pos] for pos in seeded_positions], torch.long, logits.device)
            keys = [_draw_key(expanded[pos]) for pos in seeded_positions]
            raced = _exponential_race(probs[index], keys, None, self._noise_kernels())
            for pos, token in zip(seeded_positions, raced.tolist()):
                chosen[pos] = token
        num_accepted = [0] * len(rows)
        token_ids: list[list[int]] = [[] for _ in rows]
        rejection_rows = []  # unseeded random rows
        for i, vr in enumerate(rows):
            if not vr.row.params.is_greedy and vr.row.params.seed is None:
                rejection_rows.append(i)
                continue
            m = _first_mismatch(vr.draft_token_ids, chosen[starts[i] : starts[i + 1]])
            num_accepted[i] = m
            token_ids[i] = [*vr.draft_token_ids[:m], chosen[starts[i] + m]]
        if rejection_rows:
            assert probs is not None
            normalized = probs / probs.sum(dim=-1, keepdim=True)  # [random positions, vocab]
            self._verify_random(rows, rejection_rows, starts, normalized, local, generator, num_accepted, token_ids)

        emitted = [(i, starts[i] + k, t) for i, tokens in enumerate(token_ids) for k, t in enumerate(tokens)]
        logprobs: list[list[float] | None] = [None] * len(rows)
        top_logprobs: list[list[list[tuple[int, float]]] | None] = [None] * len(rows)
        asking = [e for e in emitted if rows[e[0]].row.params.logprobs is not None]
        if asking:
            index = upload([pos for _, pos, _ in asking], torch.long, logits.device)
            tokens = upload([t for _, _, t in asking], torch.long, logits.device)
            lps, tops = _gather_logprobs(raw.index_select(0, index), tokens, [expanded[pos] for _, pos, _ in asking])
            for i in {i for i, _, _ in asking}:
                logprobs[i], top_logprobs[i] = [], []
            for (i, _, _), lp, top in zip(asking, lps, tops):
                logprobs[i].append(lp)  # type: ignore[union-attr, arg-type]
                top_logprobs[i].append(top)  # type: ignore[union-attr, arg-type]
        return VerifyResult(token_ids, num_accepted, logprobs, top_logprobs)

    @staticmethod
    def finish_verify(launched: PendingVerify | VerifyResult) -> VerifyResult:
        """A launched verification's result (the host waits for the verification alone here)."""
        if isinstance(launched, VerifyResult):
            return launched
        read = launched.download.read()  # the accepted drafts per row, then the last token per row
        n = len(launched.rows)
        token_ids = [[*vr.draft_token_ids[: read[i]], read[n + i]] for i, vr in enumerate(launched.rows)]
        return VerifyResult(token_ids, read[:n], [None] * n, [None] * n)

    def _launch_fused(
        self, logits: torch.Tensor, rows: Sequence[VerifyRow], generator: torch.Generator | None
    ) -> PendingVerify:
        """`launch_verify` of rows that all pass `_verifies_fused`: one kernel, read later."""
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor; got dtype {logits.dtype}")
        n = len(rows)
        # NOTE: greedy rows draw nothing: a batch of them takes no seeds from the generator
        seeds = (torch.zeros(n, dtype=torch.long, device=logits.device) if all(vr.row.params.is_greedy for vr in rows)
                 else torch.randint(0, 1 << 62, (n,), device=logits.device, generator=generator))
        temperatures = [0.0 if vr.row.params.is_greedy else vr.row.params.temperature for vr in rows]
        draft_probs = [vr.draft_probs for vr in rows]
        # NOTE: a draft on the device is passed as placeholders of its length, patched there.
        drafts = [vr.draft_token_ids if vr.draft_on_device is None else [0] * len(vr.draft_token_ids) for vr in rows]
        on_device = [vr.draft_on_device for vr in rows]
        out = self._kernel_module().verify(logits, drafts, draft_probs, temperatures, seeds, on_device)
        return PendingVerify(out, Download(out), rows)

    @staticmethod
    def _verify_random(
        rows: Sequence[VerifyRow],
        random_rows: list[int],
        starts: list[int],
        probs: torch.Tensor,  # [random positions, vocab], normalized
        local: dict[int, int],
        generator: torch.Generator | None,
        num_accepted: list[int],
        token_ids: list[list[int]],
    ) -> None:
        """Rejection sampling of unseeded random rows, drawing from `generator`; fills num_accepted
        and token_ids in place. All rows at once on the device (drafts padded to the longest K with
        rows that can never be accepted), and one read of the results."""
        device, vocab_size = probs.device, probs.shape[1]
        n, k_max = len(random_rows), max(len(rows[i].draft_token_ids) for i in random_rows)
        # q: the draft distributions [n, K + 1, vocab], zero past each row's K (a row's "draft" at its
        # own K is zero, so the residual there is p itself: the bonus token).
        q = torch.zeros(n, k_max + 1, vocab_size, device=device)
        for j, i in enumerate(random_rows):
            k = len(rows[i].draft_token_ids)
            q[j, :k] = _draft_dist(rows[i], vocab_size, device)
        # p at every position [n, K + 1, vocab]: row j's position k < K_j + 1 from probs, past it
        # (never read) its last position again.
        positions, drafted, valid = [], [], []
        for i in random_rows:
            drafts = list(rows[i].draft_token_ids)
            k = len(drafts)
            positions.extend(local[starts[i] + min(m, k)] for m in range(k_max + 1))
            drafted.extend(drafts + [0] * (k_max - k))
            valid.extend([1] * k + [0] * (k_max - k))
        host = upload(positions + drafted + valid, torch.long, device)
        num_p = n * (k_max + 1)
        p = probs.index_select(0, host[:num_p]).view(n, k_max + 1, vocab_size)
        drafted_t = host[num_p : num_p + n * k_max].view(n, k_max, 1)
        valid_t = host[num_p + n * k_max :].view(n, k_max).bool()
        p_draft = p[:, :k_max].gather(2, drafted_t).squeeze(2)  # [n, K]
        q_draft = q[:, :k_max].gather(2, drafted_t).squeeze(2)  # [n, K]
        uniforms = torch.rand(n, k_max, device=device, generator=generator)  # [n, K]
        accept = (uniforms * q_draft <= p_draft) & valid_t  # accept with probability min(1, p / q)
        m = accept.long().cumprod(dim=1).sum(dim=1)  # [n]: drafts accepted before the first rejection
        at = torch.arange(n, device=device)
        p_m, q_m = p[at, m], q[at, m]  # [n, vocab]
        residual = (p_m - q_m).clamp_min(0.0)
        # p <= q everywhere only by rounding (a rejection then has probability ~0): fall back to p.
        final = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_m)
        last = _exponential_race(final, [None] * n, generator)
        read = torch.cat([m, last]).tolist()
        for j, i in enumerate(random_rows):
            num_accepted[i] = read[j]
            token_ids[i] = [*rows[i].draft_token_ids[: read[j]], read[n + j]]


def _words(mask: TokenMask | None, bitmask: torch.Tensor | None, draw_rows: list[int],
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused draw's grammar words: (bitmask on the device, [len(draw_rows)] int32 rows of it:
    draw row r's, or -1 where it has no grammar); None without a mask."""
    if mask is None or bitmask is None:
        return None
    where = {row: k for k, row in enumerate(mask.rows)}
    return bitmask, upload([where.get(r, -1) for r in draw_rows], torch.int32, device)


def _fusable(params: SamplingParams) -> bool:
    """A row the fused kernel draws: greedy (its argmax, in the same launch as the random rows'), or random
    with no truncation (top-k, top-p, min-p)."""
    return params.is_greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p == 0.0)


def _verifies_fused(vr: VerifyRow) -> bool:
    """A row the fused verification takes: greedy, or `_fusable` and unseeded (a seeded row's token is
    its own race's, not rejection sampling's); no penalty, no logprobs, and min_tokens met at its first
    position (so at every one: no EOS mask applies)."""
    params = vr.row.params
    return (
        (params.is_greedy or (_fusable(params) and params.seed is None))
        and not has_penalty(params)
        and params.logprobs is None
        and len(vr.row.output_token_ids) >= params.min_tokens
    )


def _first_mismatch(drafts: Sequence[object], wanted: Sequence[object]) -> int:
    """Index of the first drafts[i] != wanted[i], or len(drafts)."""
    for i, d in enumerate(drafts):
        if d != wanted[i]:
            return i
    return len(drafts)


def _draft_dist(vr: VerifyRow, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[K, vocab] float32 the drafts were drawn from; one-hot rows for point masses."""
    if vr.draft_probs is not None:
        return vr.draft_probs.to(device=device, dtype=torch.float32)
    ids = upload(list(vr.draft_token_ids), torch.long, device)
    return torch.nn.functional.one_hot(ids, vocab_size).float()


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """-inf on EOS and stop token ids of the rows still short of min_tokens. logits: [rows, vocab]."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens or row.params.grammar is not None:
            continue
        # Ids outside the vocabulary can never be sampled; they need no mask.
        banned = {t for t in itertools.chain(eos_token_ids, row.params.stop_token_ids) if 0 <= t < vocab_size}
        row_index.extend([i] * len(banned))
        token_index.extend(banned)
    if not row_index:
        return logits
    device = logits.device
    indices = (upload(row_index, torch.long, device), upload(token_index, torch.long, device))
    return logits.index_put(indices, torch.full((), _NEG_INF, dtype=logits.dtype, device=device))


def has_penalty(params: SamplingParams) -> bool:
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


def _whole_output(row: SamplingRow) -> Sequence[int]:
    """The request's whole output so far: a moved request's continuation carries the outputs of its
    earlier attempts at the end of its prompt (num_prior_output_tokens of them), then its own."""
    n = row.num_prior_output_tokens
    if n <= 0:
        return row.output_token_ids
    return [*row.prompt_token_ids[len(row.prompt_token_ids) - n :], *row.output_token_ids]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, out of place. logits: [rows, vocab] float32.

    repetition_penalty r, over tokens seen in the prompt or the output: logit / r if logit > 0,
    else logit * r. Then, over tokens of the output (the request's whole output, earlier attempts'
    included: `_whole_output`): logit -= frequency_penalty * count + presence_penalty * (count > 0).
    Rows without penalties are returned unchanged.
    """
    penalized_rows = [i for i, row in enumerate(rows) if has_penalty(row.params)]
    if not penalized_rows:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    params = [rows[i].params for i in penalized_rows]
    index = upload(penalized_rows, torch.long, device)  # [pen]
    sub = logits.index_select(0, index)  # [pen, vocab]
    outputs = [_whole_output(rows[i]) for i in penalized_rows]
    output_counts = _token_counts(outputs, vocab_size, device)  # [pen, vocab]
    in_output = output_counts > 0  # [pen, vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([rows[i].prompt_token_ids for i in penalized_rows], vocab_size, device)
        seen = in_output | (prompt_counts > 0)  # [pen, vocab]
        repetition = upload([p.repetition_penalty for p in params], torch.float32, device).unsqueeze(1)  # [pen, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)

    frequency = upload([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(1)  # [pen, 1]
    presence = upload([p.presence_penalty for p in params], torch.float32, device).unsqueeze(1)  # [pen, 1]
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
    temperature = upload([p.temperature for p in params], torch.float32, device).unsqueeze(1)  # [n, 1]
    logits = logits / temperature

    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in params):
        top_k_t = upload(top_k, torch.long, device)  # [n]
        top_p_t = upload([p.top_p for p in params], torch.float32, device)  # [n]
        logits = _apply_top_k_top_p(logits, top_k_t, top_p_t)

    probs = logits.softmax(dim=-1)  # [n, vocab]
    if any(p.min_p > 0.0 for p in params):
        min_p = upload([p.min_p for p in params], torch.float32, device).unsqueeze(1)  # [n, 1]
        # The ratio to the top probability does not change with renormalization, so min-p after
        # top-k/top-p keeps the same tokens as min-p on the temperature-scaled distribution.
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _draw_key(row: SamplingRow) -> int | None:
    """The draw seed of a seeded row's token; None for rows that share the caller's generator."""
    seed = row.params.seed
    return None if seed is None else draw_seed(seed, row.output_position)


def _exponential_race(
    probs: torch.Tensor, keys: Sequence[int | None], shared: torch.Generator | None, kernels: ModuleType | None = None
) -> torch.Tensor:
    """One token per row of probs [n, vocab] (unnormalized is fine) -> [n] int64.

    A row with a key (`draw_seed`) draws its noise from a generator seeded with it alone; the
    others share `shared` (torch's default generator when None). With `kernels`
    (engine.sampling_kernels, CUDA), the keyed rows' noise, the same values, comes from one launch.
    """
    noise = torch.empty_like(probs)  # [n, vocab]
    shared_rows = [i for i, key in enumerate(keys) if key is None]
    keyed_rows = [i for i, key in enumerate(keys) if key is not None]
    if keyed_rows and kernels is not None:
        n = len(keyed_rows)
        rows_and_keys = upload([*keyed_rows, *(as_int64(keys[i]) for i in keyed_rows)],  # type: ignore[arg-type]
                               torch.long, probs.device)
        keyed_noise = kernels.keyed_noise(rows_and_keys[n:], probs.shape[1])
        if n == len(keys):
            noise = keyed_noise
        else:
            noise.index_copy_(0, rows_and_keys[:n], keyed_noise)
    elif keyed_rows:
        # NOTE: one generator re-seeded per row: a draw reads its seed when it is issued, also on CUDA.
        keyed = torch.Generator(device=probs.device)
        for i, key in enumerate(keys):
            if key is not None:
                noise[i].exponential_(generator=keyed.manual_seed(key))  # [vocab]; a view, filled in place
    if len(shared_rows) == len(keys):
        noise.exponential_(generator=shared)
    elif shared_rows:
        index = upload(shared_rows, torch.long, probs.device)  # [shared]
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

    index = upload(asking, torch.long, raw_logits.device)  # [asking]
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
