"""A request's state inside one engine: its tokens, how many of them have KV, and its blocks.

Token positions, for a request with P prompt and O output tokens:

| positions                         | meaning                                          |
|-----------------------------------|--------------------------------------------------|
| [0, num_computed_tokens)          | KV written in `block_ids`                        |
| [num_computed_tokens, num_tokens) | still to compute (prompt, or all after preempt)  |

A request samples in a step only when that step computes its last token. A request in decode
(num_computed_tokens == num_tokens - 1) may carry a `draft` of K proposed tokens: the step then
also computes positions [num_tokens, num_tokens + K) with the drafted tokens as input, and keeps
the KV of those it accepts (engine/spec/).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.config import SamplingParams
from engine.kv_cache import BlockHash, hash_full_blocks


class DeviceTokens(NamedTuple):
    """Drafted tokens the host has not read yet: a draft's i-th token is tokens[index[i]]."""

    tokens: torch.Tensor  # [n] int64, on the device
    index: Sequence[int]


class Draft:
    """Tokens proposed to follow a request's current tokens, and what they were drawn from.

    A draft model's tokens may still be on the device when it proposes them (`on_device`, with
    `read` the proposal's one read of all of them): `token_ids` reads them on first use. A step
    that needs only the device copies (its forward's inputs, the fused verification) then waits
    for the draft model only at its end, so the host plans the target's step while the device
    drafts. NOTE: until read, `token_ids`' storage holds placeholders; use `head` or `token_ids`.
    """

    __slots__ = ("_read", "_token_ids", "on_device", "probs")

    def __init__(
        self,
        token_ids: list[int],  # K >= 1
        # [K, vocab] float32: the distribution each drafted token was drawn from (rows sum to 1);
        # None: point masses (n-gram lookup, greedy drafting).
        probs: torch.Tensor | None = None,
        on_device: DeviceTokens | None = None,
        read: Callable[[], None] | None = None,  # fills token_ids in place (idempotent)
    ) -> None:
        if (on_device is None) != (read is None):
            raise ValueError("a draft on the device needs its read, and only such a draft has one")
        self._token_ids, self.probs, self.on_device, self._read = token_ids, probs, on_device, read

    @property
    def is_read(self) -> bool:
        return self._read is None

    @property
    def token_ids(self) -> list[int]:
        if self._read is not None:
            read, self._read = self._read, None
            read()
        return self._token_ids

    def head(self, k: int) -> DraftHead:
        """The first k tokens, read only when an element is asked for."""
        return DraftHead(self, k)

    def __len__(self) -> int:
        return len(self._token_ids)


class DraftHead(Sequence[int]):
    """A draft's first k tokens as a sequence: its length without a read, its tokens after one."""

    __slots__ = ("_draft", "_k")

    def __init__(self, draft: Draft, k: int) -> None:
        self._draft, self._k = draft, min(k, len(draft))

    @property
    def on_device(self) -> DeviceTokens | None:
        """The first k tokens on the device, while the draft is unread."""
        d = self._draft
        if d.is_read or d.on_device is None:
            return None
        return DeviceTokens(d.on_device.tokens, d.on_device.index[: self._k])

    def __len__(self) -> int:
        return self._k

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self._draft.token_ids[: self._k][index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._draft.token_ids[: self._k])


class TokenTail(Sequence[int]):
    """tokens[start:] as a read-only sequence, without copying: valid until tokens changes (a
    step's sampling rows are read before the step appends its tokens)."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens, self._start = tokens, start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return self._tokens[self._start :][index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"token index {index} out of range for {n} tokens")
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, None)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # its KV is to be computed (new, or preempted: its blocks were freed)
    READY = "ready"  # its prompt KV sits in its blocks (computed elsewhere): it waits for a place in the batch
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks of token_ids
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    stop_token_id: int | None = None
    num_preemptions: int = 0
    hold_kv: bool = False  # prefill role: on finish, keep the blocks held for the KV push
    # A moved request's continuation: the last prompt tokens that an earlier worker generated as
    # output. Seeded sampling counts output positions from the first of them (engine/sampler.py).
    num_prior_output_tokens: int = 0
    draft: Draft | None = None  # proposed for the next step; valid while num_tokens is unchanged
    # Decayed counts of this request's verified drafted tokens (engine/spec/adaptive.py): accepted,
    # and tested (accepted plus the first rejected of each step).
    num_draft_accepted: float = 0.0
    num_draft_tested: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def output_view(self) -> TokenTail:
        """output_token_ids without the copy (sampling rows: O(1) a request a step)."""
        return TokenTail(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """block_hashes, extended in place to every full block of token_ids."""
        if len(self.token_ids) >= (len(self.block_hashes) + 1) * block_size:
            self.block_hashes = hash_full_blocks(self.token_ids, block_size, self.block_hashes)
        return self.block_hashes
