"""CUDA graphs for decode-only steps: captured once per batch size, replayed with padding.

A step is graph-eligible (`plan_decode_step`) when every sequence computes exactly one token and
returns exactly that token's logits (no prefill chunk of more than one token, no speculative
verification rows), the batch fits the largest captured size, and every context fits
`max_context`. It runs the graph of the smallest captured size >= its batch; the rows past the
batch are padding:

| rows | input id | position | slot | seq_len | block-table row |
| --- | --- | --- | --- | --- | --- |
| [0, num_seqs) | its token | its position p | its KV slot of p | p + 1 | its first cdiv(p + 1, block_size) blocks |
| [num_seqs, graph_size) | 0 | 0 | -1 (nothing stored) | 1 | block 0 |

A padding row attends one key (slot 0 of block 0: finite, since the cache starts zeroed and holds
only written K/V) and writes only its own output row, which is never read. Rows never mix (matmuls,
norms, rotary and attention are per row or per sequence), so padding cannot change a real row.
Only rounding can differ from an eager step: matmuls of the padded height may pick other tiles,
and the decode attention splits contexts by max_context rather than by the step's contexts.

Per step on the host: one pass over the sequences into the runner's staging buffer (pinned), one
non_blocking copy to the device, three device-side copies into the static buffers, one replay.
Nothing reads a device value back: the step's only synchronization is the sampler reading the
sampled tokens. The runner computes the logits of the first num_seqs rows outside the graph.

Capture (once, after the KV cache exists, before any step): sizes largest first, each warmed up
once eagerly on the capture stream (Triton compiles its kernels, cuBLAS sets up its workspace for
that stream), then captured on that stream into one memory pool shared by all sizes. Sharing is
safe in any replay order: replays never overlap, and every tensor a replay reads or writes after
it ends (inputs, the hidden-state output, the attention workspace, the KV cache) lives outside
the pool. On a device other than CUDA nothing is captured and `run` calls the same code eagerly
on the static buffers (CPU tests check the padding and staging that way).

Knows nothing of scheduling or sampling; asks the attention backend for its graph mode
(`supports_cuda_graphs`, `graph_mode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.models import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.runner import ForwardSeq, HostStaging, TokenPatch

__all__ = [
    "DecodeGraphs",
    "DecodeStepLayout",
    "capture_sizes",
    "cuda_graphs_enabled",
    "fill_decode_step",
    "graph_size_for",
    "plan_decode_step",
]


def cuda_graphs_enabled(config: ModelConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether an engine captures decode graphs: not enforce_eager, a CUDA device, and a backend
    that declares `supports_cuda_graphs`."""
    return not config.enforce_eager and device.type == "cuda" and bool(getattr(backend, "supports_cuda_graphs", False))


def capture_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes, ascending: the powers of two up to max_batch_size, and max_batch_size."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
    sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size}
    return sorted(sizes | {max_batch_size})


def graph_size_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds num_seqs sequences; None if none does."""
    return next((size for size in sizes if size >= num_seqs), None)


@dataclass(frozen=True)
class DecodeStepLayout:
    """One graph step's place in the int64 staging buffer, in this order:

    | values | what |
    | --- | --- |
    | [0, g) | input ids |
    | [g, 2g) | positions |
    | [2g, 3g) | slots |
    | [3g, 4g) | seq_lens |
    | [4g, 4g + g * num_block_cols) | block tables [g, num_block_cols], row-major |

    g = graph_size. num_block_cols = the most blocks a real row needs (cdiv(seq_len, block_size));
    the kernels read no block-table column past a row's context, so the static table's columns
    beyond num_block_cols keep stale (valid) block ids.
    """

    num_seqs: int  # real rows [0, num_seqs); the rest up to graph_size are padding
    graph_size: int
    num_block_cols: int

    @property
    def num_values(self) -> int:
        return self.graph_size * (4 + self.num_block_cols)


def plan_decode_step(
    seqs: Sequence[ForwardSeq], sizes: Sequence[int], max_context: int, block_size: int
) -> DecodeStepLayout | None:
    """The layout of a graph-eligible step (see the module docstring), or None to run it eagerly."""
    num_seqs = len(seqs)
    graph_size = graph_size_for(num_seqs, sizes) if num_seqs else None
    if graph_size is None:
        return None
    longest = 0
    for s in seqs:
        if len(s.token_ids) != 1 or s.num_logits != 1:
            return None
        longest = max(longest, s.start + 1)
    if longest > max_context:
        return None
    return DecodeStepLayout(num_seqs, graph_size, -(-longest // block_size))


def fill_decode_step(buffer: np.ndarray, seqs: Sequence[ForwardSeq], layout: DecodeStepLayout, block_size: int) -> None:
    """Writes the step's values, padding rows included, into buffer[:layout.num_values] (int64)."""
    g, num_pad = layout.graph_size, layout.graph_size - layout.num_seqs
    positions = [s.start for s in seqs]
    slots = [s.block_ids[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)]
    buffer[: 4 * g] = (
        [s.token_ids[0] for s in seqs] + [0] * num_pad
        + positions + [0] * num_pad
        + slots + [-1] * num_pad
        + [p + 1 for p in positions] + [1] * num_pad
    )  # fmt: skip
    tables = buffer[4 * g : layout.num_values].reshape(g, layout.num_block_cols)
    tables.fill(0)  # padding rows: block 0
    for i, (s, p) in enumerate(zip(seqs, positions)):
        num_blocks = p // block_size + 1
        tables[i, :num_blocks] = s.block_ids[:num_blocks]


class DecodeGraphs:
    """Static device buffers, one CUDA graph per captured batch size, and the step that fills and
    replays them. Owned by a ModelRunner; shares its staging buffer."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        staging: HostStaging,
        max_batch_size: int,
        max_context: int,
    ) -> None:
        graph_mode = getattr(backend, "graph_mode", None)
        if not getattr(backend, "supports_cuda_graphs", False) or graph_mode is None:
            raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs; use 'triton'")
        if max_context < 1:
            raise ValueError(f"max_context={max_context} must be at least 1")
        self.model = model
        self.kv_caches = kv_caches
        self.staging = staging
        self.device = device = kv_caches.device
        self.is_cuda = device.type == "cuda"
        self.sizes = capture_sizes(max_batch_size)
        self.block_size = block_size = kv_caches.shape[3]
        self.max_context = max_context
        self.backend = graph_mode(max_context, self.sizes, device)
        max_size, max_block_cols = self.sizes[-1], -(-max_context // block_size)
        # Static buffers, all rows padding until a step fills them (capture runs on padding only,
        # so it stores no K/V).
        self.tokens = torch.zeros(3, max_size, dtype=torch.long, device=device)  # rows: input ids, positions, slots
        self.tokens[2].fill_(-1)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # one query a row
        self.block_tables = torch.zeros(max_size, max_block_cols, dtype=torch.int32, device=device)
        weight = model.model.embed_tokens.weight
        self.hidden = torch.zeros(max_size, weight.shape[1], dtype=weight.dtype, device=device)  # [rows, hidden]
        self._metadata = {size: self._metadata_for(size) for size in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_stream: torch.cuda.Stream | None = None
        self.num_replays = 0  # graph steps run (CPU: eager runs of the same code)
        self.num_padding_rows = 0  # padding rows computed by those steps

    def _metadata_for(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with. Its host lists are fixed: one query
        per row, and max_context standing for every context (the real ones are on the device)."""
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[self.max_context] * size,
            block_tables=[[] for _ in range(size)],  # not known on the host; the backend reads the tensor
            block_tables_tensor=self.block_tables[:size],
            seq_lens_tensor=self.seq_lens[:size],
            query_start_loc_tensor=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_context,
        )

    def _body(self, size: int) -> None:
        """The captured work: the model over the first `size` static rows into self.hidden."""
        hidden = self.model(
            self.tokens[0, :size], self.tokens[1, :size], self.kv_caches, self._metadata[size], self.backend
        )
        self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, in one shared pool (CUDA); nothing elsewhere."""
        if not self.is_cuda:
            return
        pool = torch.cuda.graph_pool_handle()
        self._capture_stream = stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        for size in reversed(self.sizes):
            # NOTE: warm up on the stream that captures, outside the capture: kernels compile and
            # load, and per-stream library state (cuBLAS workspace) is allocated, before capture.
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._body(size)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # NOTE: thread_local (as torch.compile's CUDA graph trees): CUDA calls of other threads
            # of the process (a transport's, Ray's) do not break the capture; this thread's unsafe
            # calls still fail it.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._body(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, seqs: Sequence[ForwardSeq], patch: TokenPatch | None = None) -> torch.Tensor | None:
        """Runs a graph-eligible step; returns the hidden states of its real rows [num_seqs, hidden]
        (a view of the static output: read it before the next step), or None if the step is not
        eligible (nothing was done)."""
        layout = plan_decode_step(seqs, self.sizes, self.max_context, self.block_size)
        if layout is None:
            return None
        g, cols = layout.graph_size, layout.num_block_cols
        fill_decode_step(self.staging.host(layout.num_values), seqs, layout, self.block_size)
        staged = self.staging.upload(layout.num_values)  # [num_values] int64 on the device
        self.tokens[:, :g].copy_(staged[: 3 * g].view(3, g))
        self.seq_lens[:g].copy_(staged[3 * g : 4 * g])
        self.block_tables[:g, :cols].copy_(staged[4 * g :].view(g, cols))
        if patch is not None:
            patch.apply(self.tokens[0, :g])  # NOTE: a view: patched in the static buffer, before the replay
        if self.is_cuda:
            self._graphs[g].replay()
        else:
            self._body(g)
        self.num_replays += 1
        self.num_padding_rows += g - layout.num_seqs
        return self.hidden[: layout.num_seqs]
