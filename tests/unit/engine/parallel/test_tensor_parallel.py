"""Tensor parallelism on the CPU (gloo, ranks 1..N-1 on threads): TP=2 and TP=4 give TP=1's greedy
tokens and logprobs in float32 on every test architecture, with fewer KV heads than ranks (TP=4 of
2 KV heads), a vocabulary the ranks do not divide, asynchronous scheduling (input tokens on rank 0's
device) and speculative decoding, with only rank 0 reading token ids; sizes that do not divide say which field."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine import LLM
from engine.config import SamplingParams
from engine.engine import EngineCore
from engine.llm import engine_config
from engine.models import load_arch
from engine.models.llama import LlamaForCausalLM
from engine.parallel import TensorParallel, TPGroup, TPShard, check_tensor_parallel, local_arch
from engine.parallel.shard import Shard
from engine.runner import ModelRunner
from tests.builders import make_hf_checkpoint
from tests.conftest import assert_no_leak

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], list(range(40, 90))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture
def run(one_torch_thread: None) -> Iterator[Callable[..., list[Any]]]:
    built: list[LLM] = []

    def generate(model: Path, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY,
                 **options: Any) -> list[Any]:
        llm = LLM(str(model), device="cpu", num_blocks=64, **options)
        built.append(llm)
        try:
            return llm.generate(prompts, params)
        finally:
            llm.close()

    generate.built = built  # type: ignore[attr-defined]  # the engines built, for their stats
    yield generate
    for llm in built:
        assert_no_leak(llm)


def _same(outputs: list[Any], reference: list[Any]) -> None:
    for out, ref in zip(outputs, reference, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_and_tp4_give_tp1_tokens(name: str, hf_checkpoints: Callable[[str], Path], run: Any) -> None:
    model = hf_checkpoints(name)
    reference = run(model)
    for size in (2, 4):  # the test models have 2 KV heads: TP=4 replicates each on two ranks
        _same(run(model, tensor_parallel_size=size), reference)


def test_vocabulary_the_ranks_do_not_divide(tmp_path: Path, run: Any) -> None:
    model = make_hf_checkpoint("qwen3", tmp_path / "odd_vocab", vocab_size=2045, tie_word_embeddings=True)
    _same(run(model, tensor_parallel_size=4), run(model))  # 2045 rows padded to 2048; tied lm_head


def test_async_scheduling_hands_device_tokens_to_the_ranks(hf_checkpoints: Callable[[str], Path], run: Any) -> None:
    model = hf_checkpoints("llama3")
    reference = run(model)
    _same(run(model, tensor_parallel_size=2, async_scheduling=True), reference)
    assert run.built[-1].engine.async_scheduling


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_only_rank_0_reads_token_ids(hf_checkpoints: Callable[[str], Path], run: Any, monkeypatch: Any,
                                     async_scheduling: bool) -> None:
    """Rank 0 embeds every token; the other ranks, given other ids, still give TP=1's tokens."""
    model = hf_checkpoints("llama")
    reference = run(model)
    forward, last = ModelRunner.forward, load_arch(model).vocab_size - 1  # NOTE: a row of rank 1's half

    def other_ids(runner: ModelRunner, seqs: Any, patch: Any = None) -> Any:
        if runner.leader is None:  # NOTE: another rank's runner (TP=2's rank 0 hands off)
            seqs = [seq._replace(token_ids=[last] * len(seq.token_ids)) for seq in seqs]
        return forward(runner, seqs, patch)

    monkeypatch.setattr(ModelRunner, "forward", other_ids)
    _same(run(model, tensor_parallel_size=2, async_scheduling=async_scheduling), reference)


def test_rank_0_holds_the_whole_embedding_and_a_tied_lm_head_is_its_rows_other_ranks_none(tmp_path: Path) -> None:
    model = make_hf_checkpoint("qwen3", tmp_path / "odd_vocab", vocab_size=2045, tie_word_embeddings=True)
    arch = load_arch(model)
    group = SimpleNamespace(size=4)
    ranks = [LlamaForCausalLM(arch, TensorParallel(TPShard(r, 4), group)) for r in range(4)]  # type: ignore[arg-type]
    assert [m.model.embed_tokens.weight.shape[0] for m in ranks] == [2045, 512, 512, 512]
    assert [m.lm_head.weight.shape[0] for m in ranks] == [512] * 4
    zero = ranks[0]
    assert zero.lm_head.weight.data_ptr() == zero.model.embed_tokens.weight.data_ptr()
    assert not hasattr(zero.model.embed_tokens.weight, "shard")
    assert ranks[3].model.embed_tokens.weight.shard == Shard(0, 1536, 2048, 2045)
    untied = make_hf_checkpoint("llama", tmp_path / "untied", vocab_size=2048, tie_word_embeddings=False)
    ranks = [LlamaForCausalLM(load_arch(untied), TensorParallel(TPShard(r, 2), group))  # type: ignore[arg-type]
             for r in range(2)]
    assert [m.model.embed_tokens.weight.shape[0] for m in ranks] == [2048, 0]  # rank 1 holds no rows it reads
    assert ranks[1].model.embed_tokens.weight.shard == Shard(0, 1024, 1024, 2048)


def test_speculative_decoding_over_tp(hf_checkpoints: Callable[[str], Path], run: Any) -> None:
    model = hf_checkpoints("qwen2")
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(100, 140))]
    reference = run(model, prompts)
    _same(run(model, prompts, tensor_parallel_size=2, speculative={"method": "ngram", "num_draft_tokens": 3}),
          reference)
    assert run.built[-1].engine.stats().num_spec_verifications > 0  # the ranks did verify drafts


def test_sizes_that_do_not_divide_name_the_field(hf_checkpoints: Callable[[str], Path]) -> None:
    model = hf_checkpoints("llama")
    arch = load_arch(model)  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(arch, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(dataclasses.replace(arch, num_heads=6, num_kv_heads=4, intermediate_size=96), 3)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel(dataclasses.replace(arch, intermediate_size=130), 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(model), device="cpu", num_blocks=8, tensor_parallel_size=8)  # before any rank starts



def test_an_engine_starts_its_ranks_and_close_stops_them(hf_checkpoints: Callable[[str], Path]) -> None:
    engine = EngineCore(engine_config(str(hf_checkpoints("llama")), device="cpu", num_blocks=8, tensor_parallel_size=2))
    ranks = engine.ranks
    assert ranks is not None and ranks.is_alive() and engine.ranks_alive
    assert engine.stats().parallel == "TP=2, small all-reduces on gloo"  # on CUDA: symmetric memory or NCCL
    engine.close()
    assert not ranks.is_alive() and engine.ranks is None


def test_close_shuts_the_ranks_down_together(hf_checkpoints: Callable[[str], Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a rank's NCCL shutdown returned only once every rank had called its own (2x H200): a
    follower waited in it while rank 0 waited for the follower to exit. A barrier of the ranks stands in
    for that here: close() must reach it from rank 0 while the follower waits there."""
    met: list[int] = []
    barrier = threading.Barrier(2, timeout=10)
    shutdown = TPGroup.shutdown

    def collective_shutdown(group: TPGroup) -> None:
        barrier.wait()
        met.append(group.rank)
        shutdown(group)

    monkeypatch.setattr(TPGroup, "shutdown", collective_shutdown)
    engine = EngineCore(engine_config(str(hf_checkpoints("llama")), device="cpu", num_blocks=8, tensor_parallel_size=2))
    ranks = engine.ranks
    engine.close()
    assert sorted(met) == [0, 1] and not barrier.broken
    assert ranks is not None and not ranks.is_alive()


def test_each_rank_holds_its_part(hf_checkpoints: Callable[[str], Path]) -> None:
    arch = load_arch(hf_checkpoints("llama"))
    parts = [local_arch(arch, TPShard(r, 4)) for r in range(4)]
    assert {(p.num_heads, p.num_kv_heads, p.intermediate_size) for p in parts} == {(1, 1, 32)}
    assert [TPShard(r, 4).kv_heads(arch) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TPShard(r, 4).vocab(10) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_stats_sum_every_rank_s_allocator_counts_without_waiting_for_them(hf_checkpoints: Callable[[str], Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 asks the other ranks with a RankCall and reads their answers at a later stats call: the first
    call has rank 0's own counts alone, later ones every rank's (on the CPU the counts are stand-ins), with
    the other ranks' loop seconds: launching the forwards of the steps taken, and the RankCalls (the asks)."""
    import time

    import engine.parallel.rank_stats as rank_stats

    monkeypatch.setattr(rank_stats, "allocator_counts", lambda device: (3, 7))
    monkeypatch.setattr("engine.engine.allocator_counts", lambda device: (1, 2))  # rank 0's own
    engine = EngineCore(engine_config(str(hf_checkpoints("llama")), device="cpu", num_blocks=8,
                                      tensor_parallel_size=2))
    try:
        first = engine.stats()
        assert (first.num_alloc_retries, first.num_device_frees) == (1, 2)
        deadline, later = time.monotonic() + 30, first
        while (later.num_alloc_retries, later.num_device_frees) == (1, 2) and time.monotonic() < deadline:
            time.sleep(0.01)
            later = engine.stats()
        assert (later.num_alloc_retries, later.num_device_frees) == (4, 9)
        assert later.follower_forward_seconds == 0.0  # no step taken yet
        engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        for _ in range(10):
            engine.step()
        while later.follower_forward_seconds == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
            later = engine.stats()
        assert later.follower_forward_seconds > 0.0
        # NOTE: on the CPU the other rank is a thread of this process: this pass is its collector's pause too
        gc.collect()
        while later.follower_gc_seconds == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
            later = engine.stats()
        assert later.follower_gc_seconds > 0.0 and later.follower_longest_gc_seconds <= later.follower_gc_seconds
        assert 0.0 < later.follower_call_seconds  # the asks before it, each a RankCall
        assert 0.0 <= later.follower_longest_call_seconds <= later.follower_call_seconds
    finally:
        engine.close()
