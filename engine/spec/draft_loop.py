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
before the replay (the graph itself draws nothing; a batch of greedy rows draws none). Each pass's
draw is one Triton launch (engine/spec/draft_draw.py). The distribution each draft was drawn from
(softmax, or one-hot for greedy rows) is returned for verification, so rejection sampling stays
exact.

Static rows past the batch are padding (slot -1: nothing stored; one key of block 0; temperature
1), as in engine/cuda_graphs.py. On a device other than CUDA nothing is captured and `run` calls
the same code eagerly (CPU tests check it that way, through the Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import SamplingParams
from engine.cuda_graphs import capture_graphs, capture_sizes, graph_attention, graph_size_for
from engine.models import LlamaForCausalLM
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
        vocab = model.lm_head.weight.shape[0]
        self.max_block_cols = -(-max_context // self.block_size)
        # Inputs, written in place before each replay (padding until a run fills them): per row its
        # last token's position `start`, its tokens at start - 1 and start, whether it is a row of the
        # run, its greedy flag and temperature (float64 bits), in one int64 buffer that one copy fills;
        # and the block tables. The graph derives every pass's positions, slots and sequence lengths
        # from them (`_derive`), so a chained run (`chain`) only moves `start` and the two tokens.
        self._regions = {name: b for name in ("start", "prev", "last", "valid", "greedy", "temperature")}
        self._num_inputs = sum(self._regions.values())
        self._inputs = torch.zeros(self._num_inputs, dtype=torch.long, device=device)
        inputs = self._views(self._inputs)
        self._start, self._prev, self._last = inputs["start"], inputs["prev"], inputs["last"]
        self._valid, self._greedy = inputs["valid"], inputs["greedy"]
        self._temperature = inputs["temperature"].view(torch.float64)
        # Derived in the graph: the first pass's rows 2j and 2j + 1 are row j's positions start - 1 and
        # start; passes 1 .. K - 1 have one row a request (row i - 1 of the [q, b] ones).
        q = max(p - 1, 1)
        self.first_tokens = torch.zeros(2 * b, dtype=torch.long, device=device)
        self.first_positions = torch.zeros(2 * b, dtype=torch.long, device=device)
        self.first_slots = torch.full((2 * b,), -1, dtype=torch.long, device=device)
        self.positions = torch.zeros(q, b, dtype=torch.long, device=device)
        self.slots = torch.full((q, b), -1, dtype=torch.long, device=device)
        self.first_seq_lens = torch.ones(2 * b, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(q, b, dtype=torch.int32, device=device)
        self.first_block_tables = torch.zeros(2 * b, self.max_block_cols, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, self.max_block_cols, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(2 * b + 1, dtype=torch.int32, device=device)
        self._offsets = torch.arange(1, q + 1, dtype=torch.long, device=device).unsqueeze(1)  # [q, 1]: passes 1 ..
        self.noise = torch.ones(p, b, vocab, dtype=torch.float32, device=device)
        # Outputs: each pass's draws and the distributions they were drawn from.
        self.tokens = torch.zeros(p, b, dtype=torch.long, device=device)
        self.dists = torch.zeros(p, b, vocab, dtype=torch.float32, device=device)
        self._rows = 0  # rows of the last run, whose draws `tokens` holds (0: none since the last capture)
        self._first_metadata = {size: self._first_metadata_for(size) for size in self.sizes}
        self._metadata = {size: [self._metadata_for(size, i) for i in range(p - 1)] for size in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0

    def _views(self, values: torch.Tensor | np.ndarray) -> dict[str, Any]:
        """The input regions of `values` (the device buffer, or its host image), by name."""
        views, offset = {}, 0
        for name, count in self._regions.items():
            views[name] = values[offset : offset + count]
            offset += count
        return views

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
        """Pass i's draws from logits [size, vocab] float32 into tokens[i] and dists[i] (one launch,
        engine/spec/draft_draw.py); returns tokens[i]."""
        from engine.spec.draft_draw import draft_draw  # NOTE: Triton, imported where a loop runs (as the sampler's)

        tokens = self.tokens[i, :size]
        draft_draw(logits, self._temperature[:size], self._greedy[:size], self.noise[i, :size], tokens,
                   self.dists[i, :size])
        return tokens

    def _derive(self, size: int) -> None:
        """Every pass's tokens, positions, slots and sequence lengths of the first `size` rows, from
        the rows' inputs and block tables (padding rows: position 0, slot -1, one key)."""
        bs = self.block_size
        start, valid = self._start[:size], self._valid[:size] != 0
        tables = self.block_tables[:size]
        self.first_block_tables[: 2 * size].copy_(tables.repeat_interleave(2, dim=0))
        first = torch.stack([start - 1, start], dim=1).view(-1) * valid.repeat_interleave(2)  # [2 * size]
        first_slots = self.first_block_tables[: 2 * size].gather(1, (first // bs).unsqueeze(1)).squeeze(1) * bs
        self.first_tokens[: 2 * size].copy_(torch.stack([self._prev[:size], self._last[:size]], dim=1).view(-1))
        self.first_positions[: 2 * size].copy_(first)
        self.first_slots[: 2 * size].copy_(torch.where(valid.repeat_interleave(2), first_slots + first % bs, -1))
        self.first_seq_lens[: 2 * size].copy_(first + 1)
        if self.num_passes == 1:
            return  # NOTE: no later pass (start + 1 may lie past the block tables)
        later = (start.unsqueeze(0) + self._offsets) * valid  # [q, size]
        slots = tables.gather(1, (later // bs).t()).t() * bs + later % bs
        self.positions[:, :size].copy_(later)
        self.slots[:, :size].copy_(torch.where(valid, slots, -1))
        self.seq_lens[:, :size].copy_(later + 1)

    def _body(self, size: int) -> None:
        """The captured work: the inputs derived, the two-row first pass, then num_passes - 1 passes
        feeding the last draws."""
        n = 2 * size
        self._derive(size)
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
        n, p = len(rows), self.num_passes
        size = graph_size_for(n, self.sizes)
        if size is None or any(r.start + p > self.max_context or r.start < 1 for r in rows):
            return None
        # One int64 upload: the inputs' buffer image (rows past `size` are not read by its graph; rows
        # n .. size - 1 are padding: not valid, greedy off, temperature 1), then the block tables.
        blocks = [r.block_ids[: -(-(r.start + p) // self.block_size)] for r in rows]
        cols = max(len(b) for b in blocks)
        values = self.staging.host(self._num_inputs + size * cols)
        image = self._views(values)
        start, prev, last, valid = (image[name][:size] for name in ("start", "prev", "last", "valid"))
        greedy, temperature = image["greedy"][:size], image["temperature"][:size].view(np.float64)
        start[:] = prev[:] = last[:] = valid[:] = greedy[:] = 0
        temperature[:] = 1.0
        for j, r in enumerate(rows):
            start[j], (prev[j], last[j]), valid[j] = r.start, r.tokens, 1
            greedy[j] = r.temperature <= 0
            temperature[j] = r.temperature if r.temperature > 0 else 1.0
        staged = self._upload_with_tables(values, self._num_inputs, size, blocks)
        self._inputs.copy_(staged[: self._num_inputs])
        self._replay(n, size, any(r.temperature > 0 for r in rows), generator)
        return self.tokens[:, :n], self.dists[:, :n]

    @torch.inference_mode()
    def chain(
        self, verified: torch.Tensor, order: Sequence[int], block_ids: Sequence[Sequence[int]], is_random: bool,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next run of the last run's rows, queued before the host knows how many of their drafts
        the target kept: `verified` [2 * v] int32 on the device is the verification of those drafts
        (engine/sampling_kernels.verify: v accepted counts, then v last tokens) and row j's is number
        order[j] there (-1: a row no request drafts from any more, padding from now on). Row j moves
        on on the device: m accepted, its new last token at start + m + 1 (the target's), the one
        before it d_m (this loop's draw of the last run; its old last token when m = 0). block_ids[j]
        covers the furthest that can reach, start + 2K + 1 positions (the caller checked max_context).
        Returns `run`'s views."""
        n = self._rows
        if n == 0 or len(order) != n or len(block_ids) != n:
            raise ValueError(f"chain() continues the last run's {n} rows; got {len(order)} rows")
        size = graph_size_for(n, self.sizes)
        assert size is not None
        v = verified.shape[0] // 2
        values = self.staging.host(n + size * max(len(b) for b in block_ids))
        values[:n] = order
        where = self._upload_with_tables(values, n, size, block_ids)[:n]
        if min(order) < 0:  # rows no request drafts from any more: padding from now on
            self._valid[:n].mul_(where >= 0)
            where = where.clamp_min(0)
        accepted = verified.index_select(0, where).long()  # [n]
        drafted = self.tokens[:, :n].gather(0, (accepted - 1).clamp_min(0).unsqueeze(0)).squeeze(0)
        self._prev[:n].copy_(torch.where(accepted > 0, drafted, self._last[:n]))
        self._last[:n].copy_(verified.index_select(0, where + v).long())
        self._start[:n].add_(accepted + 1)
        self._replay(n, size, is_random, generator)
        return self.tokens[:, :n], self.dists[:, :n]

    def _upload_with_tables(
        self, values: np.ndarray, offset: int, size: int, block_ids: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Writes the rows' block tables [size, cols] (zeros past each row's blocks and past the rows)
        into the staged `values` from `offset`, uploads it all, fills `block_tables`; the staged copy."""
        cols = max(len(b) for b in block_ids)
        tables = values[offset : offset + size * cols].reshape(size, cols)
        tables[:] = 0
        for j, blocks in enumerate(block_ids):
            tables[j, : len(blocks)] = blocks
        staged = self.staging.upload(offset + size * cols)
        self.block_tables[:size, :cols].copy_(staged[offset:].view(size, cols))
        return staged

    def _replay(self, n: int, size: int, is_random: bool, generator: torch.Generator | None) -> None:
        if is_random:  # NOTE: greedy rows read no noise (the draw clamps it above 0)
            self.noise[:, :size].exponential_(generator=generator)
        if self.is_cuda:
            self._graphs[size].replay()
        else:
            self._body(size)
        self._rows = n
        self.num_runs += 1
