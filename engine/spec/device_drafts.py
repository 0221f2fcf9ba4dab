"""A model proposer's drafted tokens: drawn on the device as the target would draw them, and read
back once, when first used (the draft model's, engine/spec/draft_model.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.pinned import Download
from engine.sampler import Sampler, SamplingRow
from engine.spec.base import DraftRequest

__all__ = ["DRAFT_PLACEHOLDER", "DeviceDrafts", "Drafting", "draw_drafts"]


class Drafting(Protocol):
    """One request's drafting in a proposal: its drafts so far and their distributions."""

    request: DraftRequest
    token_ids: list[int]
    probs: list[torch.Tensor]


DRAFT_PLACEHOLDER = -1  # a drafted token still on the device (read once, when first used)


def draw_drafts(sampler: Sampler, jobs: Sequence[Drafting], logits: torch.Tensor, generator: torch.Generator | None,
                on_device: bool) -> torch.Tensor:
    """Draws each job's next drafted token from its logits row [jobs, vocab], as the target would
    process it, and appends it and its distribution to the job; returns the tokens [jobs] on the
    device. on_device: each job gets DRAFT_PLACEHOLDER (no job applies penalties, so no draw reads
    the values); else the values, read now."""
    rows = []
    for j in jobs:
        r = j.request
        output = list(r.token_ids[r.num_prompt_tokens :]) + j.token_ids
        # A seeded draft races with the target's noise for the same output position: the target
        # then accepts it as often as that coupling allows (engine/sampler.py).
        rows.append(SamplingRow(r.params, r.token_ids[: r.num_prompt_tokens], output, r.num_prior_output_tokens))
    token_ids, probs = sampler.launch_with_probs(logits, rows, generator)
    values = [DRAFT_PLACEHOLDER] * len(jobs) if on_device else token_ids.tolist()
    for j, token, p in zip(jobs, values, probs):
        j.token_ids.append(token)
        j.probs.append(p)
    return token_ids


class DeviceDrafts:
    """A proposal's drafted tokens on the device, copied into one flat tensor (a loop graph's draws
    are views of its static output, which its next run overwrites while a draft may wait unread), and
    their one read into place of the jobs' placeholders. `passes`: each pass's draws and the jobs
    they are for, in order (None: a row that is drawn and never read)."""

    def __init__(self, jobs: Sequence[Drafting | None],
                 passes: Sequence[tuple[torch.Tensor, Sequence[Drafting | None]]]) -> None:
        self.tokens = torch.cat([t for t, _ in passes])  # [sum of pass sizes] int64
        self._download = Download(self.tokens)  # NOTE: a read waits for this proposal alone
        self.jobs = [j for j in jobs if j is not None]
        self.index: dict[int, list[int]] = {id(j): [] for j in self.jobs}  # a job's tokens in self.tokens
        offset = 0
        for tokens, active in passes:
            assert len(active) == len(tokens), "a pass draws one token per active job"
            for row, j in enumerate(active):
                if j is not None:
                    self.index[id(j)].append(offset + row)
            offset += len(active)
        self.is_done = False

    def read(self) -> None:
        if self.is_done:
            return
        self.is_done = True
        self.fill(self._download.read())

    def fill(self, values: list[int]) -> None:
        """Each job's placeholders, from the values read (a job keeping fewer than it was drawn for
        keeps the first ones)."""
        for j in self.jobs:
            j.token_ids[:] = [values[x] for x in self.index[id(j)][: len(j.token_ids)]]
