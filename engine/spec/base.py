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
from engine.request import Draft
from engine.sampler import Sampler


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
