"""The draft model's drafting passes 2..K in one CUDA graph, sampling included.

After the first pass (the catch-up, which drafts d_1), each further pass feeds the previous draft
and draws the next from the draft's logits. Run one by one, every pass costs a graph replay and
a dozen small sampling launches on the host, and at batch 1 the host is the bottleneck. Here the
K - 1 passes and their draws are captured as one graph per batch size (1, 2, 4, ... up to
max_batch): one replay drafts d_2 .. d_K for every row.

Rows it serves (`DraftLoopGraphs.serves`), everything else drafts pass by pass as before:
greedy rows, and random rows with a temperature only (no seed, top-k, top-p, min-p, penalties,
pending min_tokens), all drafting the same K. A random row's draw is the exponential race over
softmax(logits / temperature), the Sampler's own draw for such a row; its noise comes from the
engine's generator, drawn eagerly into a static buffer just before the replay (the graph itself
draws nothing). The distribution each draft was drawn from (softmax, or one-hot for greedy rows)
is returned for verification, so rejection sampling stays exact.

Static rows past the batch are padding (slot -1: nothing stored; one key of block 0; temperature
1), as in engine/cuda_graphs.py. On a device other than CUDA nothing is captured and `run` calls
the same code eagerly (CPU tests check it that way, through the Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import SamplingParams
from engine.cuda_graphs import capture_graphs, capture_sizes, graph_attention, graph_size_for
from engine.models import LlamaForCausalLM
from engine.pinned import upload
from engine.sampler import has_penalty

if TYPE_CHECKING:
    from engine.runner import HostStaging

__all__ = ["DraftLoopGraphs", "LoopRow"]


class LoopRow(NamedTuple):  # NOTE: a NamedTuple: one per drafting request a step
    """One drafting row: where its first fed draft goes and its sampling temperature."""

    start: int  # position of d_1 (fed in the first captured pass)
    block_ids: Sequence[int]  # covering positions [0, start + num_passes)
    temperature: float  # 0.0: greedy


class DraftLoopGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        staging: HostStaging,  # the draft runner's: its uploads and this one's never overlap
        num_passes: int,  # K - 1
        max_batch: int,
        max_context: int,
    ) -> None:
        if num_passes < 1:
            raise ValueError(f"num_passes={num_passes} must be at least 1 (K >= 2)")
        self.model, self.kv_caches, self.staging, self.num_passes = model, kv_caches, staging, num_passes
        self.device = device = kv_caches.device
        self.is_cuda = device.type == "cuda"
        self.sizes = capture_sizes(max_batch)
        self.block_size = kv_caches.shape[3]
        self.max_context = max_context
        self.backend = graph_attention(backend, max_context, self.sizes, device)
        b, p = self.sizes[-1], num_passes
        self.vocab_size = vocab = model.lm_head.weight.shape[0]
        self.max_block_cols = -(-max_context // self.block_size)
        # Inputs (padding until a run fills them), written in place before each replay.
        self.first_tokens = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(p, b, dtype=torch.long, device=device)
        self.slots = torch.full((p, b), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(p, b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, self.max_block_cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.temperature = torch.ones(b, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(b, dtype=torch.bool, device=device)
        self.noise = torch.ones(p, b, vocab, dtype=torch.float32, device=device)
        # Outputs: each pass's draws and the distributions they were drawn from.
        self.tokens = torch.zeros(p, b, dtype=torch.long, device=device)
        self.dists = torch.zeros(p, b, vocab, dtype=torch.float32, device=device)
        self._metadata = {size: [self._metadata_for(size, i) for i in range(p)] for size in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0

    def _metadata_for(self, size: int, i: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[i, :size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[self.max_context] * size,
            block_tables=[[] for _ in range(size)],
            block_tables_tensor=self.block_tables[:size],
            seq_lens_tensor=self.seq_lens[i, :size],
            query_start_loc_tensor=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_context,
        )

    @staticmethod
    def serves(params: Sequence[SamplingParams], num_outputs: Sequence[int], num_drafts: Sequence[int], k: int) -> bool:
        """Whether one run of a loop drafting `k` tokens (num_passes + 1) can draft for these rows
        (see the module docstring): per row its params, its output tokens so far, and how many tokens
        it drafts, which must be k (its draft blocks cover no more)."""
        if any(n != k for n in num_drafts):
            return False
        for sp, n in zip(params, num_outputs):
            if has_penalty(sp) or n < sp.min_tokens:
                return False
            if not sp.is_greedy and (sp.seed is not None or 0 < sp.top_k or sp.top_p < 1.0 or sp.min_p > 0.0):
                return False
        return True

    def _body(self, size: int) -> None:
        """The captured work: num_passes forward passes of `size` rows, each feeding the last draws."""
        tokens = self.first_tokens[:size]
        temperature, greedy = self.temperature[:size].unsqueeze(1), self.greedy[:size]
        for i in range(self.num_passes):
            hidden = self.model(tokens, self.positions[i, :size], self.kv_caches, self._metadata[size][i], self.backend)
            logits = self.model.compute_logits(hidden)  # [size, vocab] float32
            probs = torch.softmax(logits / temperature, dim=-1)
            argmax = logits.argmax(dim=-1)
            tokens = torch.where(greedy, argmax, (probs / self.noise[i, :size]).argmax(dim=-1))
            self.tokens[i, :size].copy_(tokens)
            one_hot = torch.nn.functional.one_hot(argmax, self.vocab_size).to(probs.dtype)
            self.dists[i, :size].copy_(torch.where(greedy.unsqueeze(1), one_hot, probs))

    def capture(self) -> None:
        """One graph per batch size (CUDA; engine/cuda_graphs.capture_graphs); nothing elsewhere."""
        if self.is_cuda:
            self._graphs = capture_graphs(self.sizes, self._body, self.device)

    @torch.inference_mode()
    def run(
        self, first_tokens: torch.Tensor, rows: Sequence[LoopRow], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts num_passes tokens for each row, d_1 (first_tokens [rows], on the device) fed first.
        Returns views of the static outputs, read before the next run: tokens [passes, rows] and
        dists [passes, rows, vocab]; None when no captured size holds the rows."""
        n, p, bs = len(rows), self.num_passes, self.block_size
        size = graph_size_for(n, self.sizes)
        if size is None or any(r.start + p > self.max_context for r in rows):
            return None
        cols = max(-(-(r.start + p) // bs) for r in rows)
        # One int64 upload, padding rows of this size included (position 0, slot -1: nothing stored,
        # one key of block 0, greedy off): positions, slots and seq_lens [p, size], then the
        # greedy flags [size] and the block tables [size, cols].
        values = self.staging.host(3 * p * size + size + size * cols)
        values.fill(0)
        pos, slots, lens = (values[i * p * size : (i + 1) * p * size].reshape(p, size) for i in range(3))
        slots[:] = -1
        lens[:] = 1
        greedy = values[3 * p * size : 3 * p * size + size]
        tables = values[3 * p * size + size :].reshape(size, cols)
        for j, r in enumerate(rows):
            span = np.arange(r.start, r.start + p)
            blocks = np.asarray(r.block_ids[: -(-(r.start + p) // bs)], dtype=np.int64)
            pos[:, j], slots[:, j], lens[:, j] = span, blocks[span // bs] * bs + span % bs, span + 1
            tables[j, : len(blocks)] = blocks
            greedy[j] = r.temperature <= 0
        staged = self.staging.upload(values.size)
        self.positions[:, :size].copy_(staged[: p * size].view(p, size))
        self.slots[:, :size].copy_(staged[p * size : 2 * p * size].view(p, size))
        self.seq_lens[:, :size].copy_(staged[2 * p * size : 3 * p * size].view(p, size))
        self.greedy[:size].copy_(staged[3 * p * size : 3 * p * size + size])
        self.block_tables[:size, :cols].copy_(staged[3 * p * size + size :].view(size, cols))
        temperatures = [r.temperature if r.temperature > 0 else 1.0 for r in rows] + [1.0] * (size - n)
        self.temperature[:size].copy_(upload(temperatures, torch.float32, self.device))
        self.first_tokens[:n].copy_(first_tokens)
        noise = self.noise[:, :size]
        noise.exponential_(generator=generator)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # NOTE: as the Sampler's race: no 0/0
        if self.is_cuda:
            self._graphs[size].replay()
        else:
            self._body(size)
        self.num_runs += 1
        return self.tokens[:, :n], self.dists[:, :n]
