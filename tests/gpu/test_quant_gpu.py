"""On a CUDA GPU of compute capability 8.9+ (marked `gpu`): FP8 projections compiled. The Triton
activation quantization equals the torch reference bit for bit at real widths; the cuda path (the
one-launch Triton kernel for 1-2 rows, torch._scaled_mm above) equals the reference path on the
same FP8 operands (float32 accumulation both; bfloat16 output); a bfloat16 model's greedy tokens
with FP8 projections on the cuda path (CUDA graphs on) equal the reference path's on the same GPU
up to the first near-tie; so do the Triton attention kernels over an FP8 KV cache against the torch
backend's, and 4-bit (AWQ) projections on the cuda path against the reference path."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.quant.fp8 import Fp8Matmul, quantize_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU of compute capability 8.9+"),
]


def _same_until_a_near_tie(fast: list, slow: list) -> None:
    """Greedy tokens equal until the slow run's top-2 margin first falls below 0.3 (bfloat16
    activations: rounding in another order moves logprobs by ~0.1)."""
    compared = 0
    for a, b in zip(fast, slow, strict=True):
        got, want = a.outputs[0], b.outputs[0]
        for step, top in enumerate(want.top_logprobs):
            if top[0][1] - top[1][1] < 0.3:
                break
            assert got.token_ids[step] == want.token_ids[step], f"step {step}"
            compared += 1
    assert compared > 0, "every sequence met a near tie at its first step: nothing was compared"


@pytest.mark.parametrize("width", [896, 4096, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantization_equals_reference(width: int, dtype: torch.dtype) -> None:
    from engine.quant import fp8_kernels

    gen = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(33, width, device="cuda", generator=gen) * 10 ** torch.empty(33, width, device="cuda").uniform_(
        -6, 2, generator=gen)).to(dtype)
    x[0, :5] = torch.tensor([-1e-30, 1e-30, -0.0, 0.0, -1e-3])  # signed zeros keep their sign
    q, scale = fp8_kernels.quantize_rows(x)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)


@pytest.mark.parametrize("rows", [1, 2, 7, 256])
def test_cuda_path_equals_reference_path(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    w, bias = torch.randn(1536, 4096, device="cuda", generator=gen), torch.randn(1536, device="cuda").bfloat16()
    wq, ws = quantize_rows(w)
    fast = Fp8Matmul("cuda", triton=True)(x, wq, ws.view(-1), bias)
    slow = Fp8Matmul("reference", triton=False)(x, wq, ws.view(-1), bias)
    assert fast.dtype == slow.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), slow.float(), atol=0.05, rtol=1e-2)


@pytest.mark.parametrize("config", [(16, 64, 128, 1, 4, 4), (16, 32, 256, 8, 4, 3), (32, 128, 128, 4, 8, 5),
                                    (32, 64, 256, 2, 4, 4), None])
@pytest.mark.parametrize("rows", [1, 3, 16, 50])
def test_split_k_matmul_equals_reference_path(rows: int, config: tuple[int, int, int, int, int, int]) -> None:
    """The tensor-core product on CUDA (E4M3 dot, compiled) equals the reference path's float32 sums
    for every tile and split shape: K not a multiple of the slice, N not of the tile, a bias; None:
    split_k_config's. (Tiles of 64 rows failed here on an H200: 0.27 off on sums of about 55.)"""
    from engine.quant import fp8_kernels

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 3000, device="cuda", generator=gen).bfloat16()
    w, bias = torch.randn(1000, 3000, device="cuda", generator=gen), torch.randn(1000, device="cuda").bfloat16()
    wq, ws = quantize_rows(w)
    xq, xs = fp8_kernels.quantize_rows(x)
    got = fp8_kernels.split_k_matmul(xq, xs, wq, ws.view(-1), bias, torch.float32, config=config)
    want = Fp8Matmul("reference", triton=False)(x.float(), wq, ws.view(-1), bias)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)


def test_fp8_model_on_cuda_path_equals_reference_path(hf_checkpoints, make_llm) -> None:
    path = str(hf_checkpoints("qwen3"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[0, 17, 400, 33, 1021, 7], list(range(40, 90))]
    fast = make_llm(path, device="cuda", dtype="bfloat16", quantization="fp8", num_blocks=64)
    assert fast.engine.weights == "fp8 projections on the cuda path"
    slow = make_llm(path, device="cuda", dtype="bfloat16", quantization="fp8", num_blocks=64, enforce_eager=True)
    # the same weights, multiplied the slow way: the reference path and no Triton kernel (the one-row and
    # split-K products would otherwise serve every decode step before the path is looked at)
    slow.engine.runner.model.ops.fp8.__dict__.update(Fp8Matmul("reference", triton=False).__dict__)
    _same_until_a_near_tie(fast.generate(prompts, params), slow.generate(prompts, params))


@pytest.mark.parametrize(("batch", "context", "num_splits", "block_n"),
                         [(1, 1500, 24, 64), (3, 700, 1, 128), (64, 1500, 2, 128), (5, 37, 1, 64)])
def test_decode_attention_over_an_fp8_cache_equals_a_float32_reference(batch: int, context: int, num_splits: int,
                                                                       block_n: int) -> None:
    """The compiled decode kernel over a paged FP8 cache (its values converted to float16 before their dot,
    triton_kernels._values_as_f16) against float32 attention over the same E4M3 values, queries rounded to
    float16 as its dots take them: batch 1 (launched early), split and whole contexts, a short one."""
    from engine.attention.triton_kernels import decode_attention

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    blocks = -(-context // block_size)
    order = torch.randperm(batch * blocks, generator=gen, device="cuda").to(torch.int32) + 1  # block 0 unused
    tables = order.view(batch, blocks)
    shape = (batch * blocks + 1, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(batch, heads, head_dim, device="cuda", generator=gen).bfloat16()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    seq_lens[-1] = max(1, context - 5)  # a shorter last sequence
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    tokens_per_split = -(-(-(-context // num_splits)) // block_n) * block_n
    decode_attention(q, k_cache, v_cache, out, tables, seq_lens, starts, scale=head_dim ** -0.5, sliding_window=None,
                     num_splits=num_splits, tokens_per_split=tokens_per_split, max_splits=64, block_n=block_n,
                     num_stages=2)
    for b in range(batch):
        n = int(seq_lens[b])
        slots = tables[b].long()[:, None] * block_size + torch.arange(block_size, device="cuda")
        keys = k_cache.view(-1, kv_heads, head_dim)[slots.view(-1)[:n]].float()  # [n, kv_heads, head_dim]
        values = v_cache.view(-1, kv_heads, head_dim)[slots.view(-1)[:n]].float()
        qf = q[b].half().float().view(kv_heads, heads // kv_heads, head_dim)
        weights = torch.softmax(torch.einsum("hgd,nhd->hgn", qf, keys) * head_dim ** -0.5, dim=-1)
        want = torch.einsum("hgn,nhd->hgd", weights, values).reshape(heads, head_dim)
        error = float((out[b].float() - want).norm() / want.norm())
        assert error < 5e-3, f"sequence {b}: relative error {error:.2e}"  # its probabilities rounded to float16


def test_fp8_kv_cache_on_triton_equals_torch_backend(hf_checkpoints, make_llm) -> None:
    """The Triton kernels compiled over an FP8 cache (store, decode with CUDA graphs, prefill) against
    the torch backend over the same FP8 cache, bfloat16 activations, FP8 projections too."""
    path = str(hf_checkpoints("llama3"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[0, 17, 400, 33, 1021, 7], list(range(40, 90))]
    options = dict(device="cuda", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", num_blocks=64)
    fast = make_llm(path, attention_backend="triton", **options)
    slow = make_llm(path, attention_backend="torch", **options)
    assert fast.engine.runner.kv_caches.dtype == torch.float8_e4m3fn
    _same_until_a_near_tie(fast.generate(prompts, params), slow.generate(prompts, params))


def test_scaled_fp8_kv_cache_stored_by_the_rotary_kernel_equals_the_torch_backend(hf_checkpoints, make_llm,
                                                                                  tmp_path) -> None:
    """Checkpoint K/V scales and V in the thousands (a unit scale would saturate it): the Triton path stores
    K / k_scale and V / v_scale in its rotary launch, the torch backend divides and stores them itself; the
    same tokens (until a near tie), and the cache's bytes written are mostly the same."""
    from tests.quant_builders import scaled_kv_checkpoint

    path = scaled_kv_checkpoint(hf_checkpoints("llama3"), tmp_path / "scaled", [(0.75, 12.0), (1.25, 20.0)], 3000.0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[0, 17, 400, 33, 1021, 7], list(range(40, 90))]
    options = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_blocks=64, enable_prefix_caching=False)
    fast = make_llm(str(path), attention_backend="triton", **options)
    slow = make_llm(str(path), attention_backend="torch", **options)
    assert fast.engine.kv_scales == ((0.75, 12.0), (1.25, 20.0))
    _same_until_a_near_tie(fast.generate(prompts, params), slow.generate(prompts, params))
    fast_kv, slow_kv = (llm.engine.runner.kv_caches.view(torch.uint8) for llm in (fast, slow))
    written = slow_kv != 0
    assert written.float().mean() > 0.001 and (fast_kv[written] == slow_kv[written]).float().mean() > 0.9


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 300])
def test_int4_cuda_path_equals_reference_path(rows: int) -> None:
    """int4_kernels' words kernel (its PTX conversion; row tiles of 16 and 64, K split) and, at 300 rows,
    its dequantization for cuBLAS, against dequantize-then-multiply; the weight laid out in the tiles
    Int4Matmul reads it in (words_block_n: 128 rows for these 1,536)."""
    from engine.quant.int4 import Int4Matmul, pack_nibbles, to_words, words_block_n

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).bfloat16()
    q = torch.randint(0, 16, (1536, 4096), device="cuda", generator=gen)
    scale = torch.stack((torch.rand(1536, 32, device="cuda", generator=gen).half() * 0.01,
                         torch.randint(0, 16, (1536, 32), device="cuda", generator=gen).half()), -1)
    block_n = words_block_n(pack_nibbles(q), scale)
    assert block_n == 128
    fast = Int4Matmul("cuda", triton=True)(x, *to_words(pack_nibbles(q), scale, block_n), None)
    slow = Int4Matmul("reference", triton=False)(x, pack_nibbles(q), scale, None)
    torch.testing.assert_close(fast.float(), slow.float(), atol=0.05, rtol=1e-2)


def test_awq_model_on_cuda_equals_reference_path(make_llm, tmp_path) -> None:
    """Every projection of a model of 128 hidden columns is one the words kernel takes (K a multiple of
    128); the reference model moves them back (use_fused_ops(False))."""
    from tests.builders import make_hf_checkpoint
    from tests.quant_builders import write_int4

    src = make_hf_checkpoint("qwen2", tmp_path / "src", hidden_size=128, intermediate_size=256, head_dim=32)
    write_int4(src, tmp_path / "awq", group=32)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[0, 17, 400, 33, 1021, 7], list(range(40, 90))]
    fast = make_llm(str(tmp_path / "awq"), device="cuda", dtype="bfloat16", num_blocks=64)
    assert fast.engine.weights == "4-bit projections on the cuda path"
    slow = make_llm(str(tmp_path / "awq"), device="cuda", dtype="bfloat16", num_blocks=64, enforce_eager=True)
    assert fast.engine.runner.model.int4_words
    slow.engine.runner.model.use_fused_ops(False)
    assert not slow.engine.runner.model.int4_words
    _same_until_a_near_tie(fast.generate(prompts, params), slow.generate(prompts, params))
