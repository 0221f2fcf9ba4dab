"""The draft model's whole drafting step in one CUDA graph, sampling included.

A drafting step feeds the draft model the tokens it has not seen and draws d_1 from the logits of
the last, then feeds d_{i-1} and draws d_i, K passes in all. Run one by one, every pass costs a
forward's planning and upload, a graph replay and a dozen small sampling launches on the host, and
at batch 1 the host is the bottleneck. Here the K passes and their draws are captured as one graph
per batch size (1, 2, 4, ... up to max_batch): one replay drafts d_1 .. d_K for every row.

The first pass has two query rows a request, its last two tokens (positions start - 1 and start),
so that it covers both steady states of a request the target has just verified: one token to catch
up (a draft was rejected: the bonus token) or two (all accepted: d_K, never fed, and the bonus).
With one to catch up, the row at start - 1 writes that position's KV again, from the same inputs.
Each row attends as a decode row of its own context (causal within the pair: both rows' KV is
written before either attends, as for the graph rows of engine/cuda_graphs.py).

Rows it serves (`DraftLoopGraphs.serves`), everything else drafts pass by pass: greedy rows, and
random rows with a temperature only (no seed, top-k, top-p, min-p, penalties, pending min_tokens),
each with at most two tokens to catch up. Every row drafts K: a row proposing fewer (adaptive K)
keeps the first ones, which is cheaper than leaving the graph for pass-by-pass drafting. A random
row's draw is the exponential race over softmax(logits / temperature), the Sampler's own draw for
such a row; its noise comes from the engine's generator, drawn eagerly into a static buffer just
before the replay (the graph itself draws nothing). The distribution each draft was drawn from
(softmax, or one-hot for greedy rows) is returned for verification, so rejection sampling stays
exact.

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
    from engine.pinned import HostStaging

__all__ = ["DraftLoopGraphs", "LoopRow"]

MAX_CATCH_UP = 2  # tokens a row may have to feed before drafting (the first pass's query rows)


class LoopRow(NamedTuple):  # NOTE: a NamedTuple: one per drafting request a step
    """One drafting row: its last two tokens, the position of the last, its blocks and temperature."""

    start: int  # position of the last token (>= 1): its logits draw d_1
    tokens: tuple[int, int]  # the tokens at positions start - 1 and start
    block_ids: Sequence[int]  # covering positions [0, start + num_passes)
    temperature: float  # 0.0: greedy


class DraftLoopGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        staging: HostStaging,  # the draft runner's: its uploads and this one's never overlap
        num_passes: int,  # K
        max_batch: int,
        max_context: int,
    ) -> None:
        if num_passes < 1:
            raise ValueError(f"num_passes={num_passes} must be at least 1 (K >= 1)")
        self.model, self.kv_caches, self.staging, self.num_passes = model, kv_caches, staging, num_passes
        self.device = device = kv_caches.device
        self.is_cuda = device.type == "cuda"
        self.sizes = capture_sizes(max_batch)
        self.block_size = kv_caches.shape[3]
        self.max_context = max_context
        first_sizes = [2 * size for size in self.sizes]  # the first pass runs twice as many rows
        self.backend = graph_attention(backend, max_context, sorted({*self.sizes, *first_sizes}), device)
        b, p = self.sizes[-1], num_passes
        self.vocab_size = vocab = model.lm_head.weight.shape[0]
        self.max_block_cols = -(-max_context // self.block_size)
        # Inputs (padding until a run fills them), written in place before each replay. The first
        # pass's rows: 2j and 2j + 1 are request j's positions start - 1 and start.
        self.first_tokens = torch.zeros(2 * b, dtype=torch.long, device=device)
        self.first_positions = torch.zeros(2 * b, dtype=torch.long, device=device)
        self.first_slots = torch.full((2 * b,), -1, dtype=torch.long, device=device)
        self.first_seq_lens = torch.ones(2 * b, dtype=torch.int32, device=device)
        self.first_block_tables = torch.zeros(2 * b, self.max_block_cols, dtype=torch.int32, device=device)
        # Passes 1 .. K - 1 (row i - 1 of these), one row a request.
        self.positions = torch.zeros(max(p - 1, 1), b, dtype=torch.long, device=device)
        self.slots = torch.full((max(p - 1, 1), b), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max(p - 1, 1), b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, self.max_block_cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(2 * b + 1, dtype=torch.int32, device=device)
        self.temperature = torch.ones(b, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(b, dtype=torch.bool, device=device)
        self.noise = torch.ones(p, b, vocab, dtype=torch.float32, device=device)
        # Outputs: each pass's draws and the distributions they were drawn from.
        self.tokens = torch.zeros(p, b, dtype=torch.long, device=device)
        self.dists = torch.zeros(p, b, vocab, dtype=torch.float32, device=device)
        self._first_metadata = {size: self._first_metadata_for(size) for size in self.sizes}
        self._metadata = {size: [self._metadata_for(size, i) for i in range(p - 1)] for size in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0

    def _first_metadata_for(self, size: int) -> AttentionMetadata:
        n = 2 * size
        return self._decode_metadata(n, self.first_slots[:n], self.first_seq_lens[:n], self.first_block_tables[:n])

    def _metadata_for(self, size: int, i: int) -> AttentionMetadata:
        return self._decode_metadata(size, self.slots[i, :size], self.seq_lens[i, :size], self.block_tables[:size])

    def _decode_metadata(
        self, n: int, slots: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        """n one-query rows over static buffers (their host-side lists are the graph mode's bounds)."""
        return AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=list(range(n + 1)),
            seq_lens=[self.max_context] * n,
            block_tables=[[] for _ in range(n)],
            block_tables_tensor=block_tables,
            seq_lens_tensor=seq_lens,
            query_start_loc_tensor=self.query_start_loc[: n + 1],
            max_query_len=1,
            max_seq_len=self.max_context,
        )

    @staticmethod
    def serves(params: Sequence[SamplingParams], num_outputs: Sequence[int], num_drafts: Sequence[int], k: int) -> bool:
        """Whether one run of a loop drafting `k` tokens (num_passes) can draft for these rows (see
        the module docstring): per row its params, its output tokens so far, and how many tokens it
        proposes, at most k (the loop drafts k for every row: the caller gives each row blocks for
        k, keeps the first ones, and checks the catch-up)."""
        if any(not 1 <= n <= k for n in num_drafts):
            return False
        for sp, n in zip(params, num_outputs):
            if has_penalty(sp) or n < sp.min_tokens:
                return False
            if not sp.is_greedy and (sp.seed is not None or 0 < sp.top_k or sp.top_p < 1.0 or sp.min_p > 0.0):
                return False
        return True

    def _draw(self, logits: torch.Tensor, i: int, size: int) -> torch.Tensor:
        """Pass i's draws from logits [size, vocab] float32 into tokens[i] and dists[i]; returns them."""
        temperature, greedy = self.temperature[:size].unsqueeze(1), self.greedy[:size]
        probs = torch.softmax(logits / temperature, dim=-1)
        argmax = logits.argmax(dim=-1)
        tokens = torch.where(greedy, argmax, (probs / self.noise[i, :size]).argmax(dim=-1))
        self.tokens[i, :size].copy_(tokens)
        one_hot = torch.nn.functional.one_hot(argmax, self.vocab_size).to(probs.dtype)
        self.dists[i, :size].copy_(torch.where(greedy.unsqueeze(1), one_hot, probs))
        return tokens

    def _body(self, size: int) -> None:
        """The captured work: the two-row first pass, then num_passes - 1 passes feeding the last draws."""
        n = 2 * size
        self.first_block_tables[:n].copy_(self.block_tables[:size].repeat_interleave(2, dim=0))
        hidden = self.model(
            self.first_tokens[:n], self.first_positions[:n], self.kv_caches, self._first_metadata[size], self.backend
        )
        tokens = self._draw(self.model.compute_logits(hidden[1::2]), 0, size)
        for i in range(1, self.num_passes):
            hidden = self.model(tokens, self.positions[i - 1, :size], self.kv_caches, self._metadata[size][i - 1],
                                self.backend)
            tokens = self._draw(self.model.compute_logits(hidden), i, size)

    def capture(self) -> None:
        """One graph per batch size (CUDA; engine/cuda_graphs.capture_graphs); nothing elsewhere."""
        if self.is_cuda:
            self._graphs = capture_graphs(self.sizes, self._body, self.device)

    @torch.inference_mode()
    def run(
        self, rows: Sequence[LoopRow], generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drafts num_passes tokens for each row. Returns views of the static outputs, read before
        the next run: tokens [passes, rows] and dists [passes, rows, vocab]; None when no captured
        size holds the rows or a row's drafts would pass max_context."""
        n, p, bs = len(rows), self.num_passes, self.block_size
        size = graph_size_for(n, self.sizes)
        if size is None or any(r.start + p > self.max_context or r.start < 1 for r in rows):
            return None
        cols = max(-(-(r.start + p) // bs) for r in rows)
        q = p - 1
        # One int64 upload, padding rows of this size included (position 0, slot -1: nothing stored,
        # one key of block 0, greedy off): the first pass's tokens, positions, slots and seq_lens
        # [2 * size] each; then the other passes' positions, slots and seq_lens [q, size] each; then
        # the greedy flags [size] and the block tables [size, cols].
        first, rest = 8 * size, 3 * q * size
        values = self.staging.host(first + rest + size + size * cols)
        values.fill(0)
        f_tokens, f_pos, f_slots, f_lens = (values[i * 2 * size : (i + 1) * 2 * size] for i in range(4))
        pos, slots, lens = (values[first + i * q * size : first + (i + 1) * q * size].reshape(q, size)
                            for i in range(3))
        greedy = values[first + rest : first + rest + size]
        tables = values[first + rest + size :].reshape(size, cols)
        f_slots[:] = -1
        f_lens[:] = 1
        slots[:] = -1
        lens[:] = 1
        for j, r in enumerate(rows):
            blocks = np.asarray(r.block_ids[: -(-(r.start + p) // bs)], dtype=np.int64)
            both = np.array([r.start - 1, r.start])
            f_tokens[2 * j : 2 * j + 2] = r.tokens
            f_pos[2 * j : 2 * j + 2] = both
            f_slots[2 * j : 2 * j + 2] = blocks[both // bs] * bs + both % bs
            f_lens[2 * j : 2 * j + 2] = both + 1
            span = np.arange(r.start + 1, r.start + p)
            pos[:, j], slots[:, j], lens[:, j] = span, blocks[span // bs] * bs + span % bs, span + 1
            tables[j, : len(blocks)] = blocks
            greedy[j] = r.temperature <= 0
        staged = self.staging.upload(values.size)
        self.first_tokens[: 2 * size].copy_(staged[: 2 * size])
        self.first_positions[: 2 * size].copy_(staged[2 * size : 4 * size])
        self.first_slots[: 2 * size].copy_(staged[4 * size : 6 * size])
        self.first_seq_lens[: 2 * size].copy_(staged[6 * size : first])
        if q:
            self.positions[:, :size].copy_(staged[first : first + q * size].view(q, size))
            self.slots[:, :size].copy_(staged[first + q * size : first + 2 * q * size].view(q, size))
            self.seq_lens[:, :size].copy_(staged[first + 2 * q * size : first + rest].view(q, size))
        self.greedy[:size].copy_(staged[first + rest : first + rest + size])
        self.block_tables[:size, :cols].copy_(staged[first + rest + size :].view(size, cols))
        temperatures = [r.temperature if r.temperature > 0 else 1.0 for r in rows] + [1.0] * (size - n)
        self.temperature[:size].copy_(upload(temperatures, torch.float32, self.device))
        noise = self.noise[:, :size]
        noise.exponential_(generator=generator)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # NOTE: as the Sampler's race: no 0/0
        if self.is_cuda:
            self._graphs[size].replay()
        else:
            self._body(size)
        self.num_runs += 1
        return self.tokens[:, :n], self.dists[:, :n]
