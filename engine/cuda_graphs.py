"""CUDA graphs for steps of one-query rows: captured once per row count, replayed with padding.

A graph computes `graph_size` rows, each ONE query token attending its own context: the rows of a
decode step are its sequences; a sequence computing n > 1 tokens (a speculative verification's
K+1 positions, a draft model's catch-up, a short prompt or chunk) is n rows, one per position p,
each attending positions [0, p] over the sequence's blocks. That is causal attention: every row's
K/V is stored before any row attends (the backend stores a layer's whole batch first), and row p
reads no key past p. So one decode launch serves every kind of step (its metadata says
`rows_share_sequences`). A backend that `rotates` a batch of one row per sequence (its decode launch
rotating and storing each row's own key, which no other row reads) gets graphs of its own for the
sizes where it does: a step whose rows are all distinct sequences replays those. A step is graph-eligible
(`plan_graph_step`) when its rows fit the largest captured size, every position is below
`max_context`, and its multi-row sequences' attention is small enough that reading each row's
context separately costs less than an eager step's launches: sum over them of n * (start + n)
keys at most `max_multi_row_keys` (bench.graph_rows measures where eager prefill wins). The step
runs the graph of the smallest captured size >= its rows; the rows past them are padding:

| rows | input id | position | slot | seq_len | block-table row |
| --- | --- | --- | --- | --- | --- |
| real, position p | its token | p | its KV slot of p | p + 1 | its sequence's first cdiv(p + 1, block_size) blocks |
| [num_rows, graph_size) | 0 | 0 | -1 (nothing stored) | 1 | block 0 |

A padding row attends one key (slot 0 of block 0: finite, since the cache starts zeroed and holds
only written K/V) and writes only its own output row, which is never read. Rows never mix except
through the KV they store (matmuls, norms, rotary are per row, attention per row over the cache),
so padding cannot change a real row. Only rounding can differ from an eager step: matmuls of the
padded height may pick other tiles, the decode kernel splits contexts by max_context rather than by
the step's contexts, and rows of a multi-token sequence go through the decode kernel instead of
the prefill kernel.

Per step on the host: one pass over the rows into the runner's staging buffer (pinned), one
non_blocking copy to the device, three device-side copies into the static buffers, one replay.
Nothing reads a device value back: the step's only synchronization is the sampler reading the
sampled tokens. The runner computes the logits of the step's logit rows outside the graph (all
real rows when every row returns logits, as in decode and verification steps; otherwise a gather
whose row indexes ride in the same upload).

Capture (once, after the KV cache exists, before any step): sizes largest first (the shared graphs,
then the one-row-per-sequence ones), each warmed up once eagerly on the capture stream (Triton
compiles its kernels, cuBLAS sets up its workspace for that stream), then captured on that stream
into one memory pool shared by all the graphs. Sharing is safe in any replay order: replays never
overlap, and every tensor a replay reads or writes after it ends (inputs, the hidden-state output,
the attention workspace, the KV cache) lives outside the pool. On a device other than CUDA nothing
is captured and `run` calls the same code eagerly on the static buffers (CPU tests check the
padding and staging that way).

Knows nothing of scheduling or sampling; asks the attention backend for its graph mode
(`supports_cuda_graphs`, `graph_mode`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.models import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.pinned import HostStaging
    from engine.runner import ForwardSeq, TokenPatch

__all__ = [
    "DEFAULT_MAX_MULTI_ROW_KEYS",
    "DecodeGraphs",
    "GraphStepLayout",
    "capture_graphs",
    "capture_sizes",
    "cuda_graphs_enabled",
    "fill_graph_step",
    "graph_max_rows",
    "graph_size_for",
    "plan_graph_step",
]

# Multi-row sequences of a graph step read at most this many keys per layer and KV head in all
# (sum of n * (start + n)); past it the step runs eagerly with the prefill kernel. Measured
# (bench/results/graph_rows_nvidia-h100-80gb-hbm3.json, Qwen3-0.6B shape, bf16): an eager forward
# costs 11-15 ms whatever its size up to 512 tokens (launch-bound), a graph one 1.4 ms plus the
# rows' attention; the graph is still 1.7x or more faster at 262,144 keys (a 512-token prompt, a
# 128-token chunk at context 2,048, 64 verifications of 5 at context 512) and breaks even near
# 1.3M. 262,144 keeps that margin for slower-launching models and faster devices.
DEFAULT_MAX_MULTI_ROW_KEYS = 262144

# Graph rows captured by default beyond the decode batch: short prompts and chunks joining a batch
# (bench.graph_rows: a 512-token prompt runs 2.8x faster as a 512-row graph than eagerly).
DEFAULT_MIXED_ROWS = 512


def cuda_graphs_enabled(config: ModelConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether an engine captures graphs: not enforce_eager, a CUDA device, and a backend that
    declares `supports_cuda_graphs`."""
    return not config.enforce_eager and device.type == "cuda" and bool(getattr(backend, "supports_cuda_graphs", False))


def graph_attention(backend: AttentionBackend, max_context: int, sizes: Sequence[int], device: torch.device) -> Any:
    """The backend's graph mode for captured steps of these sizes; raises if it has none."""
    graph_mode = getattr(backend, "graph_mode", None)
    if not getattr(backend, "supports_cuda_graphs", False) or graph_mode is None:
        raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs; use 'triton'")
    return graph_mode(max_context, sizes, device)


def graph_max_rows(config: EngineConfig) -> int:
    """The largest captured graph: ModelConfig.cuda_graph_max_rows, or by default enough rows for a
    full batch of verifications (max_num_seqs x (K + 1) with speculation) and at least
    DEFAULT_MIXED_ROWS (512); never more than a step's token budget."""
    if config.model.cuda_graph_max_rows is not None:
        return config.model.cuda_graph_max_rows
    per_seq = 1 + (config.speculative.num_draft_tokens if config.speculative.is_enabled else 0)
    wanted = max(config.scheduler.max_num_seqs * per_seq, DEFAULT_MIXED_ROWS)
    return max(1, min(wanted, config.scheduler.max_num_batched_tokens))


def capture_sizes(max_batch_size: int) -> list[int]:
    """Captured row counts, ascending: the powers of two up to max_batch_size, and max_batch_size."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be at least 1")
    sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size}
    return sorted(sizes | {max_batch_size})


def graph_size_for(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds num_rows rows; None if none does."""
    return next((size for size in sizes if size >= num_rows), None)


@dataclass(frozen=True)
class GraphStepLayout:
    """One graph step's place in the int64 staging buffer, in this order:

    | values | what |
    | --- | --- |
    | [0, g) | input ids |
    | [g, 2g) | positions |
    | [2g, 3g) | slots |
    | [3g, 4g) | seq_lens |
    | [4g, 4g + g * num_block_cols) | block tables [g, num_block_cols], row-major |
    | then len(logit_rows) values | the rows whose logits are returned (only when not all real rows) |

    g = graph_size. num_block_cols = the most blocks a real row needs (cdiv(p + 1, block_size));
    the kernels read no block-table column past a row's context, so the static table's columns
    beyond num_block_cols keep stale (valid) block ids.
    """

    num_rows: int  # real rows [0, num_rows); the rest up to graph_size are padding
    graph_size: int
    num_block_cols: int
    logit_rows: tuple[int, ...] | None = None  # None: every real row, in order

    @property
    def num_table_end(self) -> int:
        return self.graph_size * (4 + self.num_block_cols)

    @property
    def num_values(self) -> int:
        return self.num_table_end + (len(self.logit_rows) if self.logit_rows is not None else 0)


def plan_graph_step(
    seqs: Sequence[ForwardSeq],
    sizes: Sequence[int],
    max_context: int,
    block_size: int,
    max_multi_row_keys: int = DEFAULT_MAX_MULTI_ROW_KEYS,
) -> GraphStepLayout | None:
    """The layout of a graph-eligible step (see the module docstring), or None to run it eagerly."""
    num_rows = longest = multi_row_keys = num_logits = 0
    all_logits = True
    for s in seqs:
        n = len(s.token_ids)
        if n == 0 or s.num_logits > n:
            return None
        num_rows += n
        num_logits += s.num_logits
        all_logits = all_logits and s.num_logits == n
        end = s.start + n
        longest = max(longest, end)
        if n > 1:
            multi_row_keys += n * end
    if num_rows == 0 or longest > max_context or multi_row_keys > max_multi_row_keys:
        return None
    graph_size = graph_size_for(num_rows, sizes)
    if graph_size is None:
        return None
    logit_rows: tuple[int, ...] | None = None
    if not all_logits:
        rows: list[int] = []
        first = 0
        for s in seqs:
            first += len(s.token_ids)
            rows.extend(range(first - s.num_logits, first))
        logit_rows = tuple(rows)
    return GraphStepLayout(num_rows, graph_size, -(-longest // block_size), logit_rows)


def fill_graph_step(buffer: np.ndarray, seqs: Sequence[ForwardSeq], layout: GraphStepLayout, block_size: int) -> None:
    """Writes the step's values, padding rows included, into buffer[:layout.num_values] (int64)."""
    g, cols, num_pad = layout.graph_size, layout.num_block_cols, layout.graph_size - layout.num_rows
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables = buffer[4 * g : layout.num_table_end].reshape(g, cols)
    tables.fill(0)  # padding rows: block 0
    row = 0
    for s in seqs:
        blocks, start, n = s.block_ids, s.start, len(s.token_ids)
        ids.extend(s.token_ids)
        if n == 1:  # NOTE: the decode row, the common case, without range()
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in span)
        # Every row of the sequence gets the blocks of its last row: a row reads no column past its
        # own context (cdiv(p + 1, block_size)), and the rest are valid block ids.
        num_blocks = (start + n - 1) // block_size + 1
        tables[row : row + n, :num_blocks] = blocks[:num_blocks]
        row += n
    buffer[: 4 * g] = (
        ids + [0] * num_pad
        + positions + [0] * num_pad
        + slots + [-1] * num_pad
        + [p + 1 for p in positions] + [1] * num_pad
    )  # fmt: skip
    if layout.logit_rows is not None:
        buffer[layout.num_table_end : layout.num_values] = layout.logit_rows


@torch.inference_mode()
def capture_graphs(
    sizes: Sequence[int], body: Callable[[int], None], device: torch.device, pool: Any = None
) -> dict[int, torch.cuda.CUDAGraph]:
    """One CUDA graph of `body(size)` per size, largest first, all in one memory pool (`pool`, else a
    new one). Sharing the pool is safe in any replay order when replays never overlap and everything
    a replay reads or writes after it ends lives outside the pool (the callers' static buffers)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    stream = torch.cuda.Stream(device=device)
    current = torch.cuda.current_stream(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    for size in sorted(sizes, reverse=True):
        # NOTE: warm up on the stream that captures, outside the capture: kernels compile and
        # load, and per-stream library state (cuBLAS workspace) is allocated, before capture.
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            body(size)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local (as torch.compile's CUDA graph trees): CUDA calls of other threads
        # of the process (a transport's, Ray's) do not break the capture; this thread's unsafe
        # calls still fail it.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            body(size)
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs


class DecodeGraphs:
    """Static device buffers, one CUDA graph per captured row count, and the step that fills and
    replays them. Owned by a ModelRunner; shares its staging buffer."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        staging: HostStaging,
        max_rows: int,
        max_context: int,
        max_multi_row_keys: int = DEFAULT_MAX_MULTI_ROW_KEYS,
    ) -> None:
        if max_context < 1:
            raise ValueError(f"max_context={max_context} must be at least 1")
        self.model = model
        self.kv_caches = kv_caches
        self.staging = staging
        self.device = device = kv_caches.device
        self.is_cuda = device.type == "cuda"
        self.sizes = capture_sizes(max_rows)
        self.max_multi_row_keys = max_multi_row_keys
        self.block_size = block_size = kv_caches.shape[3]
        self.max_context = max_context
        self.backend = graph_attention(backend, max_context, self.sizes, device)
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
        self._metadata = {size: self._metadata_for(size, shared=True) for size in self.sizes}
        one_row = {size: self._metadata_for(size, shared=False) for size in self.sizes}
        # NOTE: a model with q/k norms rotates in its norm kernel: the same graph serves every step
        rotates = not model.arch.qk_norm
        self._one_row_metadata = {s: m for s, m in one_row.items() if rotates and self.backend.rotates(m)}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # any step of its size
        self._one_row_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # a step of that many sequences, a row each
        self.num_replays = 0  # graph steps run (CPU: eager runs of the same code)
        self.num_padding_rows = 0  # padding rows computed by those steps
        self.num_one_row_replays = 0  # of them, steps of the one-row-per-sequence graphs

    def _metadata_for(self, size: int, shared: bool) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with. Its host lists are fixed: one query
        per row, and max_context standing for every context (the real ones are on the device);
        `shared`: rows may be positions of one sequence."""
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
            rows_share_sequences=shared,
        )

    def _body(self, size: int, one_row: bool = False) -> None:
        """The captured work: the model over the first `size` static rows into self.hidden (`one_row`: each
        row a sequence of its own)."""
        meta = self._one_row_metadata[size] if one_row else self._metadata[size]
        hidden = self.model(self.tokens[0, :size], self.tokens[1, :size], self.kv_caches, meta, self.backend)
        self.hidden[:size].copy_(hidden)

    def capture(self) -> None:
        """One graph per size, largest first, and one more per size of `_one_row_metadata`, all in one pool
        (CUDA); nothing elsewhere."""
        if self.is_cuda:
            pool = torch.cuda.graph_pool_handle()
            self._graphs = capture_graphs(self.sizes, self._body, self.device, pool)
            self._one_row_graphs = capture_graphs(
                sorted(self._one_row_metadata), lambda size: self._body(size, one_row=True), self.device, pool
            )

    def release(self) -> None:
        """Free the graphs once the device is done with them. A tensor-parallel rank does so before its group
        shuts down: NCCL's shutdown waited forever on 2x H200 while a graph that captured its collectives was
        alive (tests/gpu/test_tp_close_gpu.py)."""
        if self._graphs:
            torch.cuda.synchronize(self.device)
            for graph in [*self._graphs.values(), *self._one_row_graphs.values()]:
                graph.reset()
            self._graphs, self._one_row_graphs = {}, {}

    @torch.inference_mode()
    def run(self, seqs: Sequence[ForwardSeq], patch: TokenPatch | None = None) -> torch.Tensor | None:
        """Runs a graph-eligible step; returns the hidden states of its logit rows [rows, hidden] (a
        view of the static output when that is every real row: read it before the next step), or None
        if the step is not eligible (nothing was done)."""
        layout = plan_graph_step(seqs, self.sizes, self.max_context, self.block_size, self.max_multi_row_keys)
        if layout is None:
            return None
        g, cols = layout.graph_size, layout.num_block_cols
        fill_graph_step(self.staging.host(layout.num_values), seqs, layout, self.block_size)
        staged = self.staging.upload(layout.num_values)  # [num_values] int64 on the device
        self.tokens[:, :g].copy_(staged[: 3 * g].view(3, g))
        self.seq_lens[:g].copy_(staged[3 * g : 4 * g])
        self.block_tables[:g, :cols].copy_(staged[4 * g : layout.num_table_end].view(g, cols))
        if patch is not None:
            patch.apply(self.tokens[0, :g])  # NOTE: a view: patched in the static buffer, before the replay
        one_row = layout.num_rows == len(seqs) and g in self._one_row_metadata  # every sequence one row
        if self.is_cuda:
            (self._one_row_graphs if one_row else self._graphs)[g].replay()
        else:
            self._body(g, one_row)
        self.num_one_row_replays += one_row
        self.num_replays += 1
        self.num_padding_rows += g - layout.num_rows
        if layout.logit_rows is None:
            return self.hidden[: layout.num_rows]
        return self.hidden.index_select(0, staged[layout.num_table_end :])
