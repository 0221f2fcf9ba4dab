"""The CUDA graph plan on the CPU: which steps a graph serves (decode rows, and sequences of several
tokens as one row per position), which captured size, the padded staging layout; the runner's one-upload staging; and, through Triton's interpreter, the graph
path's static buffers and padding rows giving the eager path's logits and KV (everything but the
capture and replay themselves, which tests/gpu/test_cuda_graphs.py checks on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import AttentionSpec
from engine.attention.torch_ref import TorchAttention
from engine.config import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.cuda_graphs import (
    DEFAULT_MIXED_ROWS,
    DecodeGraphs,
    GraphStepLayout,
    capture_sizes,
    cuda_graphs_enabled,
    fill_graph_step,
    graph_max_rows,
    graph_size_for,
    plan_graph_step,
)
from engine.kv_cache import allocate_kv_tensors
from engine.models import DEFAULT_MODEL_DIR, ArchConfig, build_model
from engine.pinned import HostStaging
from engine.runner import ForwardSeq, ModelRunner


def decode(token: int, position: int, blocks: list[int]) -> ForwardSeq:
    return ForwardSeq([token], position, blocks, 1)


# ---- sizes
def test_capture_sizes_are_powers_of_two_and_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(ValueError, match="max_batch_size=0"):
        capture_sizes(0)


def test_graph_size_is_the_smallest_that_holds_the_batch():
    sizes = capture_sizes(48)
    assert [graph_size_for(n, sizes) for n in (1, 2, 3, 5, 17, 32, 33, 48)] == [1, 2, 4, 8, 32, 32, 48, 48]
    assert graph_size_for(49, sizes) is None


# ---- eligibility
SIZES = capture_sizes(8)


def test_decode_only_steps_are_eligible():
    seqs = [decode(5, 0, [3]), decode(6, 9, [1, 2, 7]), decode(7, 3, [4])]
    assert plan_graph_step(seqs, SIZES, max_context=64, block_size=4) == GraphStepLayout(3, 4, 3)
    # A one-token prompt (start 0) is decode-shaped too.
    assert plan_graph_step([decode(5, 0, [0])], SIZES, 64, 4) == GraphStepLayout(1, 1, 1)


def test_sequences_of_several_tokens_are_one_row_per_position():
    # A verification (1 + 2 logits rows), a two-token chunk sampling its last, a one-token chunk not sampling.
    verify = ForwardSeq([5, 6, 7], 3, [1, 2], 3)
    assert plan_graph_step([decode(5, 0, [3]), verify], SIZES, 64, 4) == GraphStepLayout(4, 4, 2)
    chunk, silent = ForwardSeq([5, 6], 3, [1, 2], 1), ForwardSeq([5], 3, [1], 0)
    layout = plan_graph_step([decode(5, 0, [3]), chunk, silent], SIZES, 64, 4)
    # Rows: the decode (0), the chunk's positions 3 and 4 (1, 2: only 2 samples), the silent row (3).
    assert layout == GraphStepLayout(4, 4, 2, logit_rows=(0, 2))
    # A step that samples nothing (the draft model catching up before its loop graph): no logit rows.
    assert plan_graph_step([silent, ForwardSeq([8, 9], 6, [2, 3], 0)], SIZES, 64, 4) == GraphStepLayout(
        3, 4, 2, logit_rows=())


def test_too_many_rows_too_long_a_context_or_too_much_multi_row_attention_run_eagerly():
    assert plan_graph_step([], SIZES, 64, 4) is None
    assert plan_graph_step([decode(1, i, [i // 4]) for i in range(9)], SIZES, 64, 4) is None
    assert plan_graph_step([ForwardSeq(list(range(9)), 0, [0, 1, 2], 1)], SIZES, 64, 4) is None  # 9 rows
    blocks = list(range(16))
    assert plan_graph_step([decode(1, 63, blocks)], SIZES, 64, 4) == GraphStepLayout(1, 1, 16)
    assert plan_graph_step([decode(1, 64, blocks + [16])], SIZES, 64, 4) is None
    assert plan_graph_step([ForwardSeq([1, 2], 62, blocks, 2)], SIZES, 64, 4) is not None  # positions 62, 63
    assert plan_graph_step([ForwardSeq([1, 2], 63, blocks + [16], 2)], SIZES, 64, 4) is None  # position 64
    # Multi-row keys: n * (start + n) summed over sequences of more than one token (decode rows are free).
    seqs = [ForwardSeq([1, 2, 3, 4], 6, [0, 1, 2], 4), decode(1, 40, blocks)]  # 4 * 10 = 40 keys
    assert plan_graph_step(seqs, SIZES, 64, 4, max_multi_row_keys=40) is not None
    assert plan_graph_step(seqs, SIZES, 64, 4, max_multi_row_keys=39) is None


def test_default_graph_rows_cover_a_batch_of_verifications_and_short_prompts():
    plain = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))
    assert graph_max_rows(plain) == DEFAULT_MIXED_ROWS == 512
    wide = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=768, max_num_batched_tokens=8192))
    assert graph_max_rows(wide) == 768
    spec = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048),
        speculative=SpeculativeConfig(method="ngram", num_draft_tokens=4),
    )
    assert graph_max_rows(spec) == 640  # 128 x (1 + 4)
    assert graph_max_rows(spec.model_copy(
        update={"scheduler": SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=600)})) == 600
    small_budget = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    assert graph_max_rows(small_budget) == 64  # never more rows than a step's tokens
    told = EngineConfig(model=ModelConfig(cuda_graph_max_rows=12), scheduler=SchedulerConfig(max_num_seqs=8))
    assert graph_max_rows(told) == 12


def test_only_cuda_with_a_graph_capable_backend_and_not_eager():
    torch_backend = TorchAttention(AttentionSpec(4, 2, 16, 0.25))

    class GraphCapable:
        supports_cuda_graphs = True

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cuda_graphs_enabled(ModelConfig(), cuda, GraphCapable())  # type: ignore[arg-type]
    assert not cuda_graphs_enabled(ModelConfig(enforce_eager=True), cuda, GraphCapable())  # type: ignore[arg-type]
    assert not cuda_graphs_enabled(ModelConfig(), cpu, GraphCapable())  # type: ignore[arg-type]
    assert not cuda_graphs_enabled(ModelConfig(), cuda, torch_backend)


# ---- the padded layout
def test_staging_layout_with_padding_rows():
    block_size = 4
    seqs = [decode(11, 0, [3]), decode(12, 9, [1, 2, 7]), decode(13, 4, [4, 5])]
    layout = plan_graph_step(seqs, SIZES, 64, block_size)
    assert layout == GraphStepLayout(num_rows=3, graph_size=4, num_block_cols=3)
    buffer = np.full(layout.num_values + 5, 99, dtype=np.int64)  # 99: stale values
    fill_graph_step(buffer, seqs, layout, block_size)
    g = 4
    assert buffer[:g].tolist() == [11, 12, 13, 0]  # input ids
    assert buffer[g : 2 * g].tolist() == [0, 9, 4, 0]  # positions
    assert buffer[2 * g : 3 * g].tolist() == [3 * 4 + 0, 7 * 4 + 1, 5 * 4 + 0, -1]  # slots; padding: none
    assert buffer[3 * g : 4 * g].tolist() == [1, 10, 5, 1]  # seq_lens; padding: one key
    tables = buffer[4 * g : layout.num_values].reshape(g, 3).tolist()
    assert tables == [[3, 0, 0], [1, 2, 7], [4, 5, 0], [0, 0, 0]]  # padding row: block 0
    assert buffer[layout.num_values :].tolist() == [99] * 5  # nothing written past the layout


def test_staging_layout_of_a_multi_token_sequence_and_its_logit_rows():
    block_size = 4
    # A chunk at positions 3..5 (across a block boundary) sampling its last token, then a decode row.
    seqs = [ForwardSeq([21, 22, 23], 3, [6, 2], 1), decode(30, 1, [9])]
    layout = plan_graph_step(seqs, SIZES, 64, block_size)
    assert layout == GraphStepLayout(num_rows=4, graph_size=4, num_block_cols=2, logit_rows=(2, 3))
    buffer = np.full(layout.num_values + 3, 99, dtype=np.int64)
    fill_graph_step(buffer, seqs, layout, block_size)
    g = 4
    assert buffer[:g].tolist() == [21, 22, 23, 30]
    assert buffer[g : 2 * g].tolist() == [3, 4, 5, 1]
    assert buffer[2 * g : 3 * g].tolist() == [6 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 9 * 4 + 1]
    assert buffer[3 * g : 4 * g].tolist() == [4, 5, 6, 2]  # each row attends its own positions [0, p]
    tables = buffer[4 * g : layout.num_table_end].reshape(g, 2).tolist()
    assert tables == [[6, 2], [6, 2], [6, 2], [9, 0]]
    assert buffer[layout.num_table_end : layout.num_values].tolist() == [2, 3]  # the logit rows
    assert buffer[layout.num_values :].tolist() == [99] * 3


def test_block_columns_cover_only_the_context():
    # Blocks held past the context (e.g. allocated ahead) are not copied.
    seqs = [decode(1, 3, [8, 9, 10])]
    layout = plan_graph_step(seqs, SIZES, 64, 4)
    assert layout is not None and layout.num_block_cols == 1
    buffer = np.zeros(layout.num_values, dtype=np.int64)
    fill_graph_step(buffer, seqs, layout, 4)
    assert buffer[4:].tolist() == [8]


# ---- the runner's staging
def test_host_staging_grows_and_uploads_a_copy():
    staging = HostStaging(torch.device("cpu"))
    host = staging.host(10_000)  # past the initial capacity
    host[:] = np.arange(10_000)
    first = staging.upload(10_000)
    staging.host(3)[:] = [7, 8, 9]
    assert staging.upload(3).tolist() == [7, 8, 9]
    assert first[:3].tolist() == [0, 1, 2] and first.dtype == torch.long  # not aliased by later writes


def test_eager_prepare_packs_one_upload(make_llm):
    runner = make_llm().engine.runner
    seqs = [ForwardSeq([5, 6, 7], 2, [4, 9], 1), decode(8, 20, [1, 2, 3, 6, 0, 5]), ForwardSeq([9], 0, [7], 0)]
    ids, pos, meta, rows = runner.prepare(seqs)
    bs = runner.block_size
    assert bs == 16
    assert ids.tolist() == [5, 6, 7, 8, 9] and ids.dtype == torch.long
    assert pos.tolist() == [2, 3, 4, 20, 0] and pos.dtype == torch.long
    assert meta.slot_mapping.tolist() == [4 * bs + 2, 4 * bs + 3, 4 * bs + 4, 2 * bs + 4, 7 * bs]
    assert meta.slot_mapping.dtype == torch.long
    assert rows.tolist() == [2, 3] and rows.dtype == torch.long
    assert meta.seq_lens == [5, 21, 1] and meta.seq_lens_tensor.tolist() == [5, 21, 1]
    assert meta.query_start_loc == [0, 3, 4, 5] and meta.query_start_loc_tensor.tolist() == [0, 3, 4, 5]
    assert meta.block_tables_tensor.tolist() == [[4, 9, 0, 0, 0, 0], [1, 2, 3, 6, 0, 5], [7, 0, 0, 0, 0, 0]]
    for t in (meta.seq_lens_tensor, meta.query_start_loc_tensor, meta.block_tables_tensor):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert (meta.max_query_len, meta.max_seq_len) == (3, 21)


def test_the_engine_captures_nothing_on_the_cpu(make_llm):
    assert make_llm().engine.runner.graphs is None


def test_graphs_need_a_graph_capable_backend():
    model, arch = build_model(DEFAULT_MODEL_DIR, torch.float32, torch.device("cpu"))
    kv = allocate_kv_tensors(arch, 8, 4, torch.float32, torch.device("cpu"))
    backend = TorchAttention(AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5))
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        DecodeGraphs(model, kv, backend, HostStaging(torch.device("cpu")), 4, 64)


# ---- the graph path against the eager one (Triton interpreter)
def _eager_and_graphed(max_rows: int, seed: int) -> tuple[ModelRunner, ModelRunner, ArchConfig]:
    """Two runners of the default model on one interpreted Triton backend, over equal KV caches of
    24 blocks of 4: one eager, one through the graph path (rows up to max_rows, contexts up to 64)."""
    from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig

    torch.manual_seed(seed)
    cpu = torch.device("cpu")
    model, arch = build_model(DEFAULT_MODEL_DIR, torch.float32, cpu)
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    # Small tiles and splits, so that a 64-token bound splits the decode (static workspace, reduce).
    config = TritonAttentionConfig(
        decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_split_tokens=16, target_programs_per_sm=64
    )
    backend = TritonAttention(spec, config)
    eager = ModelRunner(model, allocate_kv_tensors(arch, 24, 4, torch.float32, cpu), backend, cpu)
    graphed = ModelRunner(model, eager.kv_caches.clone(), backend, cpu)
    graphed.capture_decode_graphs(max_rows=max_rows, max_context=64)
    return eager, graphed, arch


def test_graph_path_equals_eager_path_with_padding(interpreted_kernels):
    cpu = torch.device("cpu")
    eager, graphed, arch = _eager_and_graphed(max_rows=4, seed=0)
    graphs = graphed.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert graphs.backend._graph_split_plan(4, cpu, False)[0] > 1, "the test should cover split-K"

    # Three sequences on scattered blocks (block 0 among them); prompts of 5, 9 and 12 tokens.
    tables = [[5, 0, 11, 2, 17, 8], [3, 14, 9, 21, 6, 12], [19, 1, 22, 7, 15, 4]]
    tokens = [torch.randint(2, arch.vocab_size, (n,)).tolist() for n in (5, 9, 12)]
    prefill = [ForwardSeq(t, 0, b, 1) for t, b in zip(tokens, tables)]
    for runner in (eager, graphed):
        runner.forward(prefill)  # eager in both (not decode-only)
    assert graphs.num_replays == 0
    torch.testing.assert_close(graphed.kv_caches, eager.kv_caches, atol=0, rtol=0)

    # Decode steps of 3 (graph of 4: one padding row), 1 and 2 sequences, across block boundaries.
    for step, active in enumerate([[0, 1, 2], [0, 1, 2], [1], [0, 2], [0, 1, 2], [2]]):
        seqs = []
        for i in active:
            tokens[i].append(int(torch.randint(2, arch.vocab_size, ())))
            seqs.append(decode(tokens[i][-1], len(tokens[i]) - 1, tables[i]))
        want, got = eager.forward(seqs), graphed.forward(seqs)
        assert got.shape == want.shape == (len(active), arch.vocab_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"step {step}")
        # The same slots written (padding rows wrote none).
        torch.testing.assert_close(graphed.kv_caches, eager.kv_caches, atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 6
    assert graphs.num_padding_rows == 1 + 1 + 0 + 0 + 1 + 0


def test_graph_rows_of_prompts_and_verifications_equal_the_eager_prefill_kernel(interpreted_kernels):
    """Sequences of several tokens through the graph path (one decode row per position) give the
    logits and KV of the eager path, whose prefill kernel attends them causally in one go."""
    eager, graphed, arch = _eager_and_graphed(max_rows=16, seed=1)
    graphs = graphed.graphs
    assert graphs is not None

    def vocab_tokens(n: int) -> list[int]:
        return torch.randint(2, arch.vocab_size, (n,)).tolist()

    tables = [[5, 0, 11, 2, 17, 8], [3, 14, 9, 21, 6, 12], [19, 1, 22, 7, 15, 4]]
    tokens = [vocab_tokens(n) for n in (6, 3, 9)]
    steps = [
        # Whole prompts of 6 and 3 tokens (last logits), a chunk of 5 of the third (no logits).
        [ForwardSeq(tokens[0], 0, tables[0], 1), ForwardSeq(tokens[1], 0, tables[1], 1),
         ForwardSeq(tokens[2][:5], 0, tables[2], 0)],
        # The rest of the third prompt (4 tokens, across a block boundary), beside a decode row.
        [ForwardSeq(tokens[2][5:], 5, tables[2], 1), decode(7, 6, tables[0])],
        # Verifications: 1 + 3 positions (every logit), 1 + 1, and a plain decode row.
        [ForwardSeq(vocab_tokens(4), 7, tables[0], 4), ForwardSeq(vocab_tokens(2), 3, tables[1], 2),
         decode(9, 9, tables[2])],
    ]  # fmt: skip
    for step, seqs in enumerate(steps):
        want, got = eager.forward(seqs), graphed.forward(seqs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"step {step}")
        torch.testing.assert_close(graphed.kv_caches, eager.kv_caches, atol=1e-5, rtol=1e-5, msg=f"KV, step {step}")
    assert graphs.num_replays == 3, "every step fits the 16-row graph"
    assert graphs.num_padding_rows == (16 - 14) + (8 - 5) + (8 - 7)


def test_a_rotating_backend_replays_graphs_of_its_own_for_steps_of_one_row_a_sequence(interpreted_kernels,
                                                                                      monkeypatch):
    """With the fused ops (their rotary kernel storing K/V) a llama-family model's decode launch rotates and
    stores each row's key itself (TritonAttention.rotates). A graph step whose rows are all distinct sequences
    replays graphs captured that way; a step with several rows of one sequence (a short prompt beside a decode
    row) replays the shared graphs, where every row's key is stored before any row attends: a row's program
    storing its own key while another row of its sequence reads it would race on a GPU. Both equal eager."""
    from engine.attention.triton_backend import TritonAttention

    eager, graphed, arch = _eager_and_graphed(max_rows=8, seed=3)
    graphs = graphed.graphs
    assert graphs is not None and not arch.qk_norm
    assert sorted(graphs._one_row_metadata) == [1, 2, 4, 8]
    eager.model.use_fused_ops(True)  # NOTE: one model behind both runners
    rotated: list[bool] = []
    forward_rotated = TritonAttention.forward_rotated

    def counted(self, q, rotation, k_cache, v_cache, meta):
        rotated.append(meta.rows_share_sequences)
        return forward_rotated(self, q, rotation, k_cache, v_cache, meta)

    monkeypatch.setattr(TritonAttention, "forward_rotated", counted)
    tables = [[5, 0, 11, 2, 17, 8], [3, 14, 9, 21, 6, 12], [19, 1, 22, 7, 15, 4]]
    tokens = [torch.randint(2, arch.vocab_size, (n,)).tolist() for n in (7, 4, 3)]
    prefill = [ForwardSeq(tokens[i], 0, tables[i], 1) for i in (0, 1)]
    try:
        for runner in (eager, graphed):
            runner.forward(prefill)  # eager in both (not graph-eligible: 11 rows)
        steps = [
            [ForwardSeq(tokens[2], 0, tables[2], 1), decode(9, 7, tables[0])],  # 4 rows, one sequence's 3
            [decode(10, 8, tables[0]), decode(11, 4, tables[1]), decode(12, 3, tables[2])],  # a row a sequence
        ]
        for step, seqs in enumerate(steps):
            rotated.clear()
            want = eager.forward(seqs)
            eager_rotated, rotated[:] = list(rotated), []
            got = graphed.forward(seqs)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"step {step}")
            torch.testing.assert_close(graphed.kv_caches, eager.kv_caches, atol=1e-5, rtol=1e-5, msg=f"KV {step}")
            assert rotated == eager_rotated == ([] if step == 0 else [False] * arch.num_layers), f"step {step}"
    finally:
        eager.model.use_fused_ops(False)
    assert graphs.num_replays == 2 and graphs.num_one_row_replays == 1
