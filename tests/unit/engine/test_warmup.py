"""The engine's start-up warm-up on the CPU: its forwards reach every kernel variant the steps can
pick (engine/warmup.py's table) and fit any engine, down to one block; through Triton's
interpreter they run on the real kernels. That nothing compiles after start on a GPU is
tests/gpu/test_compile_warmup_gpu.py's to show. NOTE: the kernel modules are imported under
TRITON_INTERPRET (tests/interpreted.py says how, and why this skips otherwise)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionSpec
from engine.attention.triton_backend import TritonAttentionConfig, decode_launch_plan, decode_split_plan
from engine.attention.triton_backend import prefill_launch_tiles
from engine.kv_cache import allocate_kv_tensors
from engine.models import DEFAULT_MODEL_DIR, build_model
from engine.runner import ForwardSeq, ModelRunner
from engine.warmup import crowded_prompt_lens, draft_count_classes, warm_up_steps
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

SPLIT_K_MAX_ROWS = import_interpreted("engine.quant.fp8_kernels", "_quantize_rows_kernel").SPLIT_K_MAX_ROWS
PDL = import_interpreted("engine.pdl", "after_previous")
INT4 = import_interpreted("engine.quant.int4_kernels", "_words_kernel")
import_interpreted("engine.attention.triton_kernels", "_decode_kernel")
import_interpreted("engine.attention.triton_prefill", "_prefill_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")

H100_SMS = 132


def _rows(seqs: list[ForwardSeq]) -> int:
    return sum(len(s.token_ids) for s in seqs)


def _decode_contexts(seqs: list[ForwardSeq]) -> list[int]:
    return [s.start + 1 for s in seqs if len(s.token_ids) == 1]


@pytest.mark.parametrize(("max_seq_tokens", "block_size"), [(8192, 16), (130_000, 16), (64, 4), (8, 4), (1, 1)])
def test_steps_fit_the_engine_and_its_blocks(max_seq_tokens, block_size):
    for seqs in warm_up_steps(max_seq_tokens, block_size):
        for s in seqs:
            end = s.start + len(s.token_ids)
            assert 0 < end <= max_seq_tokens
            assert len(s.block_ids) * block_size >= end and set(s.block_ids) == {0}
            assert s.num_logits == 1


def test_steps_reach_every_row_class_and_both_decode_plans():
    steps = warm_up_steps(8192, 16)
    rows = [_rows(seqs) for seqs in steps]
    # The FP8 split-K tile classes (<= 16, <= SPLIT_K_MAX_ROWS rows), each 16-row tile launched early
    # (PDL) and not, the scaled matmul past them, and the 4-bit kernel's (row tiles of 16, 32 and 64)
    # and its dequantization past WORDS_MAX_ROWS.
    assert any(r <= PDL.PDL_PRODUCT_MAX_ROWS for r in rows) and any(PDL.PDL_PRODUCT_MAX_ROWS < r <= 16 for r in rows)
    assert any(16 < r <= SPLIT_K_MAX_ROWS for r in rows)
    assert any(r > SPLIT_K_MAX_ROWS for r in rows)
    small = [r for r in rows if r <= INT4.WORDS_MAX_ROWS]
    assert {INT4.words_config(r, 4096, 4096, 64, 132) for r in small} == {(16, 8), (32, 8), (64, 4)}
    assert any(r > INT4.WORDS_MAX_ROWS for r in rows)
    # Decode launched with its keys split over programs, and whole; beside prompts and alone; over a
    # cache of either tile plan (bfloat16's, FP8's).
    config, num_kv_heads = TritonAttentionConfig(), 8
    alone = [_decode_contexts(seqs) for seqs in steps if _rows(seqs) == PDL.PDL_ANY_MAX_ROWS == len(seqs)]
    for fp8 in (False, True):
        splits = [
            decode_split_plan(len(ctx), num_kv_heads, max(ctx), H100_SMS, config, fp8)[0]
            for ctx in map(_decode_contexts, steps)
            if ctx
        ]
        assert max(splits) > 1 and min(splits) == 1
        # One decode row alone (every kernel launched early), its keys split and whole.
        assert {decode_split_plan(1, num_kv_heads, ctx[0], H100_SMS, config, fp8)[0] > 1
                for ctx in alone if ctx} == {True, False}
        # Decode-only steps of several sequences (the rotating launch, not early), split and whole.
        several = [ctx for seqs in steps if len(ctx := _decode_contexts(seqs)) == len(seqs) > 1]
        assert {decode_split_plan(len(ctx), num_kv_heads, max(ctx), H100_SMS, config, fp8)[0] > 1
                for ctx in several} == {True, False}


@pytest.mark.parametrize("num_kv_heads", [8, 4, 1])
def test_a_crowded_decode_launch_is_warmed_up_where_the_batch_reaches_one(num_kv_heads):
    """The last forward decodes crowded_seqs sequences, its keys whole: its launch takes the crowded FP8 tiles (at
    132 SMs, as the backend counts them on an H100 or H200); without crowded_seqs no forward does."""
    config = TritonAttentionConfig()
    crowded_seqs = -(-config.decode_fp8_crowded_programs_per_sm * H100_SMS // num_kv_heads)
    steps = warm_up_steps(8192, 16, crowded_seqs)
    assert steps[:-1] == warm_up_steps(8192, 16)
    ctx = _decode_contexts(steps[-1])
    assert len(ctx) == len(steps[-1]) == crowded_seqs
    splits, _, crowded = decode_launch_plan(crowded_seqs, num_kv_heads, max(ctx), H100_SMS, config, fp8_cache=True)
    assert splits == 1
    assert crowded != decode_launch_plan(crowded_seqs - 1, num_kv_heads, max(ctx), H100_SMS, config, True)[2]
    assert crowded.num_warps == config.decode_fp8_crowded_num_warps
    for seqs in warm_up_steps(8192, 16):
        ctx = _decode_contexts(seqs)
        if ctx:
            assert decode_launch_plan(len(ctx), num_kv_heads, max(ctx), H100_SMS, config, True)[2] != crowded


def _prefill_tokens(seqs: list[ForwardSeq]) -> int:
    return sum(len(s.token_ids) for s in seqs if len(s.token_ids) > 1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "fp8"), [(32, 8, True), (64, 8, False), (64, 8, True),
                                                                 (16, 2, True)])
@pytest.mark.parametrize("max_seq_tokens", [8192, 300])
def test_a_crowded_prefill_launch_is_warmed_up_where_a_step_reaches_one(num_heads, num_kv_heads, fp8, max_seq_tokens):
    """The last forward's prompts (as many as max_seq_tokens needs) are a crowded prefill launch (at 132 SMs); no
    other forward's is; with one token fewer it would not be; an engine whose steps cannot hold them warms none
    (nor can its steps be crowded)."""
    config = TritonAttentionConfig()
    assert config.takes_crowded_prefill(num_heads // num_kv_heads, fp8)
    tokens = config.crowded_prefill_tokens(num_heads, H100_SMS)
    prompts = crowded_prompt_lens(tokens, max_seq_tokens, max_num_seqs=256, max_num_batched_tokens=8192)
    assert prompts is not None and sum(prompts) == tokens and 2 <= min(prompts) <= max(prompts) <= max_seq_tokens
    assert len(prompts) == -(-tokens // max_seq_tokens)
    steps = warm_up_steps(max_seq_tokens, 16, None, prompts)
    assert steps[:-1] == warm_up_steps(max_seq_tokens, 16)

    def tiles(num_tokens: int):
        return prefill_launch_tiles(num_tokens, num_heads, num_kv_heads, H100_SMS, config, fp8)

    crowded = config.prefill_tiles(fp8, crowded=True)
    assert tiles(_prefill_tokens(steps[-1])) == crowded != config.prefill_tiles(fp8)
    assert tiles(tokens - 1) != crowded
    assert all(tiles(_prefill_tokens(seqs)) != crowded for seqs in steps[:-1])
    assert crowded_prompt_lens(tokens, max_seq_tokens, max_num_seqs=256, max_num_batched_tokens=tokens - 1) is None
    assert crowded_prompt_lens(tokens, 8, max_num_seqs=-(-tokens // 8) - 1, max_num_batched_tokens=8192) is None
    assert crowded_prompt_lens(None, max_seq_tokens, 256, 8192) is None
    assert crowded_prompt_lens(601, 300, 256, 8192) == [300, 300, 2]  # never a one-token prompt (a decode)


def test_no_launch_is_crowded_whose_crowded_tiles_hold_too_many_query_tokens():
    """The 8B shape (group 4) in bfloat16: 256-row crowded tiles hold 64 query tokens, past
    prefill_crowded_max_tile_tokens: no launch takes them, however large."""
    config = TritonAttentionConfig()
    assert not config.takes_crowded_prefill(4, fp8_cache=False)
    assert prefill_launch_tiles(8192, 32, 8, H100_SMS, config, fp8_cache=False) == config.prefill_tiles(False)
    assert prefill_launch_tiles(8192, 32, 8, H100_SMS, config, fp8_cache=True) == config.prefill_tiles(True, True)


def test_steps_run_on_the_interpreted_kernels_in_one_block():
    from engine.attention.triton_backend import TritonAttention

    cpu = torch.device("cpu")
    model, arch = build_model(DEFAULT_MODEL_DIR, torch.float32, cpu)
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    config = TritonAttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_split_tokens=16,
                                   prefill_crowded_block_m=32, prefill_crowded_block_n=16,
                                   prefill_fp8_crowded_block_m=32, prefill_fp8_crowded_block_n=16,
                                   prefill_crowded_rows_per_sm=24)
    kv = allocate_kv_tensors(arch, 1, 16, torch.float32, cpu)
    backend = TritonAttention(spec, config)
    runner = ModelRunner(model, kv, backend, cpu)
    prompts = crowded_prompt_lens(backend.crowded_prefill_tokens(cpu), 64, 8, 256)
    assert prompts == [48]  # 24 rows x 8 SMs (the CPU's count) / 4 query heads
    steps = warm_up_steps(64, 16, None, prompts)
    assert decode_split_plan(1, arch.num_kv_heads, 64, 8, config)[0] > 1, "the test should cover split-K"
    for seqs in steps:
        logits = runner.forward_eager(seqs)
        assert logits.shape == (len(seqs), arch.vocab_size)
        assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("max_drafts", [1, 2, 3, 4, 5, 7, 8, 9, 16, 32])
def test_draft_counts_reach_every_verification_tile(max_drafts):
    def tile(k: int) -> int:
        return 1 << k.bit_length()  # the kernel's K_BLOCK: triton.next_power_of_2(k + 1)

    counts = draft_count_classes(max_drafts)
    assert all(1 <= k <= max_drafts for k in counts)
    assert {tile(k) for k in counts} == {tile(k) for k in range(1, max_drafts + 1)}
