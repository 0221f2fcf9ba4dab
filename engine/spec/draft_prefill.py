"""The draft model's KV of whole prompts, computed where the target's prompt is computed (a
prefill worker), so that a decode worker drafting with the same model adopts it on arrival
(`DraftModelProposer.adopt_prompt`) instead of computing it there, inside a step of its batch.

Prompts run through a scratch cache of their own, reused from block 0 by every call: the caller
copies each prompt's blocks out (kvtransfer.gather_blocks) before the next call. On CUDA the
draft runs on a stream of its own (`stream_context`), beside the target's steps; a copy made and
a send issued inside that context are ordered after the draft's writes and before the next
call's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from engine.config import ModelConfig, SpeculativeConfig
from engine.kv_cache import allocate_kv_tensors
from engine.models import ArchConfig
from engine.runner import ForwardSeq, ModelRunner
from engine.spec.draft_load import load_draft


class DraftPrefiller:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        target_arch: ArchConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_prompt_tokens: int,
    ) -> None:
        """`max_prompt_tokens`: the longest prompt prefilled here, and the most tokens of one call
        (a prefill worker's token budget: the prompts one engine step computes whole)."""
        if config.method != "draft":
            raise ValueError(f"a draft prefill needs speculative method 'draft', got {config.method!r}")
        draft = load_draft(config, target, target_arch, device, dtype)
        self.arch = draft.arch
        self.fingerprint = draft.fingerprint
        self.block_size = block_size
        self.num_blocks = -(-max_prompt_tokens // block_size)
        kv = allocate_kv_tensors(draft.arch, self.num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(draft.model, kv, draft.backend, device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def kv_caches(self) -> torch.Tensor:
        """[layers, 2, num_blocks, block_size, kv_heads, head_dim]: the scratch every call writes."""
        return self.runner.kv_caches

    @property
    def max_prompt_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def fits(self, num_prompt_tokens: int) -> bool:
        return 0 < num_prompt_tokens <= self.max_prompt_tokens

    @contextlib.contextmanager
    def stream_context(self) -> Iterator[None]:
        """Work queued inside runs on the draft's stream (CUDA; nothing on the CPU)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Writes the draft's KV of each prompt into the scratch, in one forward (no logits); returns
        each prompt's block ids there, in order. Call inside `stream_context`, and copy the blocks
        out inside it too, before the next call. Prompts must fit the scratch together."""
        total = sum(-(-len(p) // self.block_size) for p in prompts)
        if total > self.num_blocks or not all(p for p in prompts):
            sizes = [len(p) for p in prompts]
            raise ValueError(f"prompts of {sizes} tokens do not fit a draft prefill of {self.max_prompt_tokens} "
                             "tokens at once: split them (fits() says which fit alone)")
        seqs, block_ids, first = [], [], 0
        for p in prompts:
            blocks = list(range(first, first + -(-len(p) // self.block_size)))
            first += len(blocks)
            seqs.append(ForwardSeq(p, 0, blocks, 0))
            block_ids.append(blocks)
        self.runner.forward(seqs)
        return block_ids


def split_to_fit(prompts: Sequence[Sequence[int]], num_blocks: int, block_size: int) -> list[list[int]]:
    """Indices of `prompts` in consecutive groups whose blocks fit `num_blocks` together (each
    prompt must fit alone)."""
    groups: list[list[int]] = []
    used = num_blocks
    for i, p in enumerate(prompts):
        need = -(-len(p) // block_size)
        if used + need > num_blocks:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return groups


__all__ = ["DraftPrefiller", "split_to_fit"]
