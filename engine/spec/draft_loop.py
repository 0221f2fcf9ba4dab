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

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import SamplingParams
from engine.cuda_graphs import capture_sizes, graph_size_for
from engine.models import LlamaForCausalLM
from engine.pinned import upload
from engine.sampler import has_penalty

__all__ = ["DraftLoopGraphs", "LoopRow"]


class LoopRow:
    """One drafting row: where its first fed draft goes and its sampling temperature."""

    __slots__ = ("block_ids", "start", "temperature")

    def __init__(self, start: int, block_ids: Sequence[int], temperature: float) -> None:
        self.start = start  # position of d_1 (fed in the first captured pass)
        self.block_ids = block_ids  # covering positions [0, start + num_passes)
        self.temperature = temperature  # 0.0: greedy


class DraftLoopGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        num_passes: int,  # K - 1
        max_batch: int,
        max_context: int,
    ) -> None:
        graph_mode = getattr(backend, "graph_mode", None)
        if not getattr(backend, "supports_cuda_graphs", False) or graph_mode is None:
            raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs; use 'triton'")
        if num_passes < 1:
            raise ValueError(f"num_passes={num_passes} must be at least 1 (K >= 2)")
        self.model, self.kv_caches, self.num_passes = model, kv_caches, num_passes
        self.device = device = kv_caches.device
        self.is_cuda = device.type == "cuda"
        self.sizes = capture_sizes(max_batch)
        self.block_size = kv_caches.shape[3]
        self.max_context = max_context
        self.backend = graph_mode(max_context, self.sizes, device)
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
        self._staging = torch.zeros(0, dtype=torch.long, pin_memory=self.is_cuda)
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
    def serves(params: Sequence[SamplingParams], num_outputs: Sequence[int], num_drafts: Sequence[int]) -> bool:
        """Whether one run can draft for these rows (see the module docstring): per row its
        params, its output tokens so far, and how many tokens it drafts (all the same)."""
        if len(set(num_drafts)) > 1:
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

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per batch size, largest first, in one shared pool (CUDA); nothing elsewhere."""
        if not self.is_cuda:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        for size in reversed(self.sizes):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._body(size)  # NOTE: warm-up outside the capture (kernels compile, workspaces allocate)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._body(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

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
        # One int64 upload: positions [p, n], slots [p, n], block tables [n, cols].
        values = np.zeros(2 * p * n + n * cols, dtype=np.int64)
        pos = values[: p * n].reshape(p, n)
        slots = values[p * n : 2 * p * n].reshape(p, n)
        tables = values[2 * p * n :].reshape(n, cols)
        for j, r in enumerate(rows):
            span = np.arange(r.start, r.start + p)
            pos[:, j] = span
            blocks = np.asarray(r.block_ids[: -(-(r.start + p) // bs)], dtype=np.int64)
            slots[:, j] = blocks[span // bs] * bs + span % bs
            tables[j, : len(blocks)] = blocks
        staged = torch.from_numpy(values)
        if self.is_cuda:
            staged = staged.pin_memory().to(self.device, non_blocking=True)
        self.positions[:, :n].copy_(staged[: p * n].view(p, n))
        self.slots[:, :n].copy_(staged[p * n : 2 * p * n].view(p, n))
        self.seq_lens[:, :n].copy_(self.positions[:, :n] + 1)
        self.block_tables[:n, :cols].copy_(staged[2 * p * n :].view(n, cols))
        temperatures = [r.temperature if r.temperature > 0 else 1.0 for r in rows]
        self.temperature[:n].copy_(upload(temperatures, torch.float32, self.device))
        self.greedy[:n].copy_(upload([r.temperature <= 0 for r in rows], torch.bool, self.device))
        self.first_tokens[:n].copy_(first_tokens)
        # Padding rows of this size: nothing stored, one key, temperature 1.
        self.slots[:, n:size].fill_(-1)
        self.seq_lens[:, n:size].fill_(1)
        self.block_tables[n:size].zero_()
        self.temperature[n:size].fill_(1.0)
        self.greedy[n:size].fill_(False)
        self.first_tokens[n:size].zero_()
        noise = self.noise[:, :size]
        noise.exponential_(generator=generator)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # NOTE: as the Sampler's race: no 0/0
        if self.is_cuda:
            self._graphs[size].replay()
        else:
            self._body(size)
        self.num_runs += 1
        return self.tokens[:, :n], self.dists[:, :n]
