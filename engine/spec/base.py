"""What every proposer receives and promises, and the registry that builds one by name.

A proposer drafts tokens for running requests between target steps. The engine asks it once per
step (`propose`), before scheduling, for the decoding requests that have no draft yet; it says
when a request leaves the running batch (`drop`: finished, aborted, preempted), so any state the
proposer keeps per request (a draft model's KV blocks) is freed at once. Whatever it drafts, the
target's verification keeps the output exact: a proposer only changes how many tokens a step
yields.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.config import ModelConfig, SamplingParams, SpeculativeConfig
from engine.models import ArchConfig
from engine.pinned import Download
from engine.request import Draft
from engine.sampler import Sampler, SamplingRow


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for: its tokens so far and how many tokens to draft at most."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output; the target has KV for all but the last
    num_prompt_tokens: int
    params: SamplingParams
    num_prior_output_tokens: int  # Request.num_prior_output_tokens: where seeded draws count from
    max_draft_tokens: int  # >= 1


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may know of the engine that builds it."""

    config: SpeculativeConfig
    model: ModelConfig  # the target's: a draft model follows its dtype, load_format, seed and backend
    target_arch: ArchConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sampler: Sampler  # the target's (its EOS ids), so drafts are processed as the target's logits are
    cuda_graph_max_rows: int | None = None  # a model proposer's CUDA graphs (engine/cuda_graphs.py); None: eager


class Proposer(Protocol):
    name: ClassVar[str]
    # Bytes of the proposer's own KV per target KV block; the engine sizes its cache with them.
    kv_bytes_per_block: int

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        """Called once, after the target's cache is sized: allocate what depends on its size.
        max_seq_tokens: the longest sequence (prompt + output) the target runs."""
        ...

    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        """One draft (or None: nothing to propose) per request, each at most max_draft_tokens long.
        `generator` serves requests without a seed."""
        ...

    def chain(self, request_ids: Sequence[str], verified: torch.Tensor, generator: torch.Generator | None) -> bool:
        """Called once the target's verification of the last proposal is queued, before its read:
        may queue the next proposal for those requests on the device, from `verified` (the fused
        verification's output, engine/sampling_kernels.verify; rows in `request_ids`' order), for
        the next `propose` to adopt. False: nothing queued."""
        ...

    def skip(self) -> None:
        """Called for a step that decodes without asking for drafts: a proposal `chain` queued for a
        step that would verify it follows tokens the requests no longer end with; drop it."""
        ...

    def drop(self, request_id: str) -> None:
        """Forgets a request and frees what it held; idempotent."""
        ...

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        """Raises IntegrityError if state is held for a request not in `live_request_ids`, or a pool
        of the proposer's own is inconsistent."""
        ...


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


_PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {}


def register_proposer(cls: type) -> type:
    """Class decorator: makes a proposer available by its `name` (SpeculativeConfig.method)."""
    _PROPOSERS[cls.name] = cls
    return cls


def available_proposers() -> list[str]:
    return sorted(_PROPOSERS)


def build_proposer(context: ProposerContext) -> Proposer | None:
    """The proposer SpeculativeConfig.method names; None when speculation is off."""
    method = context.config.method
    if method == "none":
        return None
    if method not in _PROPOSERS:
        raise ValueError(f"speculative method {method!r} is unknown; available: {', '.join(available_proposers())}")
    return _PROPOSERS[method](context)
