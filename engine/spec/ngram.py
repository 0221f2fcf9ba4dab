"""N-gram prompt lookup: no model. The longest suffix of the request's tokens (prompt_lookup_max
down to prompt_lookup_min tokens) that occurred earlier in its prompt or output is looked up; the
tokens that followed its latest earlier occurrence are the draft, as point masses."""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence
from typing import ClassVar

import torch

from engine.request import Draft
from engine.spec.base import DraftRequest, ProposerContext, register_proposer

_ITEM = array("q").itemsize  # bytes per token id in the searched buffer


def lookup(token_ids: Sequence[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """Up to max_tokens tokens that followed the latest earlier occurrence of the longest suffix
    of token_ids of min_n..max_n tokens; [] when none occurred."""
    num_tokens = len(token_ids)
    data = array("q", token_ids).tobytes()
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        pattern = data[-n * _ITEM :]
        end = (num_tokens - 1) * _ITEM  # an occurrence followed by at least one token
        while (pos := data.rfind(pattern, 0, end)) >= 0:
            if pos % _ITEM == 0:  # NOTE: a byte match may straddle token ids; only aligned ones count
                start = pos // _ITEM + n
                return list(token_ids[start : start + max_tokens])
            end = pos + len(pattern) - 1
    return []


@register_proposer
class NgramProposer:
    name: ClassVar[str] = "ngram"
    kv_bytes_per_block = 0

    def __init__(self, context: ProposerContext) -> None:
        self.min_n = context.config.prompt_lookup_min
        self.max_n = context.config.prompt_lookup_max

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for r in requests:
            found = lookup(r.token_ids, self.min_n, self.max_n, r.max_draft_tokens)
            drafts.append(Draft(found) if found else None)
        return drafts

    def chain(self, request_ids: Sequence[str], verified: torch.Tensor, generator: torch.Generator | None) -> bool:
        return False  # a lookup needs the verified tokens on the host

    def skip(self) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        pass
