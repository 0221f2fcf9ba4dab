"""The FP8 KV cache (kv_cache_dtype='fp8': E4M3, unit scale) against references:

- whole models of every test architecture against transformers whose attention reads K and V
  rounded through FP8 (tests/quant_builders.fp8_kv_reference), with FP8 projections too;
- a prompt whose prefix comes from the prefix cache, and requests preempted and recomputed, give
  the tokens of a fresh computation with the same FP8 cache;
- the cache holds twice bfloat16's tokens in the same bytes (four times float32's);
- a prompt prefilled on one engine, its FP8 blocks moved as kvtransfer moves them, decodes on
  another to the colocated tokens;
- speculative decoding (n-gram and a draft model) over an FP8 cache gives the plain tokens;
  tensor parallelism over FP8 caches gives TP=1's.
Tolerances: tests/quant_builders.agrees_until_a_flip (an FP8 rounding that float32 sums put on the
other side of a boundary).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from kvtransfer import gather_blocks, scatter_blocks
from tests.builders import ARCHITECTURES, load_hf_model
from tests.quant_builders import count_close_sequences, count_runs_agreeing, fp8_kv_reference, fp8_reference

pytest.importorskip("transformers")

PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], [0, 5, 6, 7], list(range(40, 70))]
NUM_NEW = 24


def _close_sequences(llm, reference) -> int:
    return count_close_sequences(llm, reference, PROMPTS, NUM_NEW)


@pytest.mark.parametrize("weights", ["float32", "fp8"])
def test_models_with_fp8_kv_match_transformers_reading_fp8_kv(weights, hf_checkpoints, make_llm, monkeypatch):
    fp8_kv_reference(monkeypatch)
    close = 0
    for arch in ARCHITECTURES:
        path = hf_checkpoints(arch)
        options = {"quantization": "fp8"} if weights == "fp8" else {}
        llm = make_llm(str(path), kv_cache_dtype="fp8", num_blocks=64, **options)
        assert llm.engine.runner.kv_caches.dtype == torch.float8_e4m3fn
        assert llm.engine.stats().kv_cache_dtype == "float8_e4m3fn"  # what workers report (pdserve status)
        reference = load_hf_model(path)
        close += _close_sequences(llm, fp8_reference(reference) if weights == "fp8" else reference)
    total = len(ARCHITECTURES) * len(PROMPTS)
    assert close >= 0.8 * total, f"only {close} of {total} sequences within 2e-4"


def test_prefix_cache_hits_and_preemption_give_the_fresh_tokens(hf_checkpoints, make_llm):
    """Recomputation with the same FP8 cache is exact: a prompt whose prefix blocks come from the
    prefix cache (written by an earlier request) and requests preempted for want of blocks and
    recomputed give the tokens and logprobs of the fresh, unhurried run (logprobs within 2e-4: the
    fresh run's steps hold one sequence, the others' several, and a float32 CPU product's sums depend
    on its rows on some CPUs: 7e-5 apart on an AVX2 EPYC)."""
    path = str(hf_checkpoints("qwen3"))
    rng = random.Random(0)
    shared = [rng.randrange(4, 2048) for _ in range(40)]
    prompts = [shared + [rng.randrange(4, 2048) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)
    fresh = [make_llm(path, kv_cache_dtype="fp8", num_blocks=64, enable_prefix_caching=False).generate([p], params)[0]
             for p in prompts]
    cached_llm = make_llm(path, kv_cache_dtype="fp8", num_blocks=64, block_size=8)
    cached_llm.generate([prompts[0]], params)  # fills the prefix cache with the shared blocks
    cached = cached_llm.generate(prompts, params)
    assert all(o.num_cached_tokens >= 40 for o in cached)  # the shared 40 tokens: five blocks of 8
    tight_llm = make_llm(path, kv_cache_dtype="fp8", num_blocks=20, block_size=8, enable_prefix_caching=False)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.stats().num_preemptions > 0
    for f, c, t in zip(fresh, cached, tight):
        assert c.outputs[0].token_ids == f.outputs[0].token_ids == t.outputs[0].token_ids
        assert c.outputs[0].logprobs == pytest.approx(f.outputs[0].logprobs, abs=2e-4)
        assert t.outputs[0].logprobs == pytest.approx(f.outputs[0].logprobs, abs=2e-4)


def test_fp8_cache_holds_four_times_the_float32_tokens(hf_checkpoints, make_llm):
    path = str(hf_checkpoints("llama"))
    wide = make_llm(path, cpu_kv_cache_bytes=1 << 20).engine
    narrow = make_llm(path, cpu_kv_cache_bytes=1 << 20, kv_cache_dtype="fp8").engine
    assert narrow.block_bytes * 4 == wide.block_bytes
    assert narrow.pool.num_blocks == 4 * wide.pool.num_blocks


def test_fp8_blocks_moved_between_engines_decode_to_the_colocated_tokens(hf_checkpoints, make_llm):
    path = str(hf_checkpoints("llama3"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    colocated = make_llm(path, kv_cache_dtype="fp8", block_size=8)
    want = [o.outputs[0].token_ids for o in colocated.generate(prompts, params)]
    prefill = make_llm(path, kv_cache_dtype="fp8", block_size=8).engine
    decode = make_llm(path, kv_cache_dtype="fp8", block_size=8).engine
    for i, prompt in enumerate(prompts):
        prefill.add_request(str(i), prompt, params.model_copy(update={"max_tokens": 1}), hold_kv=True)
        (out,) = [o for _ in range(8) if prefill.has_unfinished() for o in prefill.step()]
        num_blocks = -(-len(prompt) // 8)
        lease = decode.reserve(f"lease-{i}", -(-(len(prompt) + 1) // 8))
        buf = gather_blocks(prefill.runner.kv_caches, out.kv_block_ids[:num_blocks])
        assert buf.dtype == torch.float8_e4m3fn
        scatter_blocks(decode.runner.kv_caches, lease[:num_blocks], buf)
        prefill.release_held(str(i))
        decode.add_prefilled(str(i), prompt, out.new_token_ids[0], params, f"lease-{i}", 0)
        tokens = list(out.new_token_ids)
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.new_token_ids]
        assert tokens == want[i]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_over_an_fp8_cache_gives_the_plain_tokens(method, make_llm):
    """Verification writes the drafted tokens' K/V into the FP8 cache and rolls rejected ones back:
    greedy output equals plain decoding over the same FP8 cache (the draft model keeps its own cache
    in the model's dtype)."""
    from engine.config import SpeculativeConfig

    rng = random.Random(5)
    motif = [rng.randrange(4, 2048) for _ in range(6)]
    prompts = [motif * 4 + [rng.randrange(4, 2048) for _ in range(n)] for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(block_size=4, kv_cache_dtype="fp8").generate(prompts, params)]
    spec = (SpeculativeConfig(method="ngram", num_draft_tokens=3) if method == "ngram"
            else SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=3))
    llm = make_llm(block_size=4, kv_cache_dtype="fp8", speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats().num_spec_draft_tokens > 0


def test_tensor_parallel_over_an_fp8_cache(hf_checkpoints, make_llm):
    """TP=2: each rank's FP8 cache holds its KV heads; TP=1's tokens up to a flip (another order of
    float32 sums can move a K or V value across an E4M3 rounding boundary)."""
    path = str(hf_checkpoints("qwen3"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    one = make_llm(path, kv_cache_dtype="fp8", num_blocks=64).generate(PROMPTS, params)
    llm = make_llm(path, kv_cache_dtype="fp8", num_blocks=64, tensor_parallel_size=2)
    assert llm.engine.runner.kv_caches.dtype == torch.float8_e4m3fn
    two = llm.generate(PROMPTS, params)
    llm.close()
    close = count_runs_agreeing(two, one, exact=1e-4)
    assert close >= 2, f"only {close} of {len(PROMPTS)} sequences within 1e-4"
