"""The fused Triton ops (engine/models/fused_kernels.py) against their PyTorch references
(engine/models/fused_ops.py), on the CPU through Triton's interpreter, fp32 and fp16 (bf16 is
wrong under the CPU interpreter; the GPU tests cover it through the whole model): odd row widths,
strided q/k views of a fused qkv output, with and without the q/k norm and the residual. fp32
must agree to float32 rounding of sums; fp16 to a unit in the last place of the output. The norm
that quantizes for an FP8 projection must equal fp8.quantize_rows of its own norm bit for bit.

NOTE: the kernels' module is imported under TRITON_INTERPRET (tests/interpreted.py says how, and
why this skips otherwise).
"""

from __future__ import annotations

import pytest
import torch

from engine.models.arch import RopeConfig
from engine.models.fused_ops import (
    DecoderOps, add_rms_norm_ref, float32_reciprocal, norm_rope_ref, rms_norm_ref, silu_and_mul_ref,
)
from engine.models.rope import RotaryEmbedding
from engine.quant.fp8 import FP8, QuantizedRows, quantize_rows
from engine.runner import ForwardSeq
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

fused_kernels = import_interpreted("engine.models.fused_kernels", "_add_rms_norm_kernel")
SWIGLU_ROW_BLOCK = fused_kernels.SWIGLU_ROW_BLOCK

DTYPES = [torch.float32, torch.float16]
pytestmark = pytest.mark.usefixtures("interpreted_triton")


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [24, 100])
def test_add_rms_norm_equals_reference(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=gen).to(dtype)
    residual = torch.randn(5, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    out, res = fused_kernels.add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_res = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(res, want_res), "the residual sum is one rounding in both"
    close(out, want_out, dtype)
    out, res = fused_kernels.add_rms_norm(x, None, weight, 1e-6)
    assert res is x
    close(out, rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (10, 3)])
def test_norm_rope_of_q_and_k_in_one_launch_equals_reference(dtype: torch.dtype, with_norm: bool, heads: int,
                                                               kv_heads: int) -> None:
    """q and k of a fused qkv output (a strided view, q's heads then k's), each normalized by its
    own weight, rotated, in one launch (a program's heads q's and k's both, or past the last head);
    the refusal of one weight without the other."""
    tokens, head_dim = 7, 16
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 9, 40, 41, 300])
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim).cos_sin(positions, dtype)
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if with_norm else None
    k_weight = (1 - 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if with_norm else None
    q, k = fused_kernels.norm_rope_qk(qk, heads, cos, sin, q_weight, k_weight, 1e-6)
    assert q.is_contiguous() and k.is_contiguous()
    close(q, norm_rope_ref(qk[:, :heads], cos, sin, q_weight, 1e-6), dtype)
    close(k, norm_rope_ref(qk[:, heads:], cos, sin, k_weight, 1e-6), dtype)
    ref_q, ref_k = DecoderOps(triton=False).norm_rope_qk(qk, heads, cos, sin, q_weight, k_weight, 1e-6)
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    if with_norm:
        with pytest.raises(ValueError, match="q_weight and k_weight come together"):
            fused_kernels.norm_rope_qk(qk, heads, cos, sin, q_weight, None, 1e-6)


@pytest.mark.parametrize("cache_dtype, scales", [(None, None), (torch.float8_e4m3fn, None),
                                                 (torch.float8_e4m3fn, (2.0, 0.5))])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (10, 3)])
def test_norm_rope_that_stores_k_and_v_equals_store_kv_after_it(cache_dtype: torch.dtype | None,
                                                                 scales: tuple[float, float] | None, with_norm: bool,
                                                                 heads: int, kv_heads: int) -> None:
    """The store in the rotary launch: q as without it, k (rotated) and v at their slots in the paged caches as
    store_kv puts them (FP8 rounded alike; a scaled cache's K / k_scale and V / v_scale: powers of two here, so
    that the kernel's product by the reciprocal is the CPU's division), a slot < 0 stored nowhere, every other
    slot untouched."""
    from engine.attention import triton_kernels
    from engine.models.fused_ops import KVStore

    dtype, tokens, head_dim, blocks, block_size = torch.float16, 5, 16, 4, 4
    gen = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim).cos_sin(torch.tensor([3, 4, 0, 7, 8]), dtype)
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if with_norm else None
    k_weight = (1 - 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) if with_norm else None
    slots = torch.tensor([5, 14, -1, 0, 9])
    before = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype or dtype)
    caches = [before.clone(), before.clone()]
    q, k = fused_kernels.norm_rope_qk(qk, heads, cos, sin, q_weight, k_weight, 1e-6)
    k_scale, v_scale = scales or (1.0, 1.0)
    triton_kernels.store_kv(k / k_scale, v / v_scale, caches[0][0], caches[0][1], slots)
    got_q, got_k = fused_kernels.norm_rope_qk(qk, heads, cos, sin, q_weight, k_weight, 1e-6,
                                              KVStore(v, caches[1][0], caches[1][1], slots, k_scale, v_scale))
    assert got_k is None and torch.equal(got_q, q)
    assert torch.equal(caches[1].view(torch.uint8), caches[0].view(torch.uint8))
    changed = (caches[1].view(torch.uint8) != before.view(torch.uint8)).flatten(3).any(-1)  # [2, blocks, offsets]
    assert changed.flatten(1).nonzero()[:, 1].unique().tolist() == [0, 5, 9, 14], "the slots, and only they"
    with pytest.raises(ValueError, match=r"go into the caches; got v \(5, 1, 16\)"):
        fused_kernels.norm_rope_qk(qk, heads, cos, sin, q_weight, k_weight, 1e-6,
                                   KVStore(v[:, :1], caches[1][0], caches[1][1], slots))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = (3 * torch.randn(3, 2 * 1500, generator=gen)).to(dtype)  # two column blocks, the second partial
    close(fused_kernels.silu_and_mul(gate_up), silu_and_mul_ref(gate_up), dtype)


def test_decoder_ops_dispatch() -> None:
    x = torch.randn(2, 8)
    w = torch.ones(8)
    assert torch.equal(DecoderOps(triton=False).add_rms_norm(x, None, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6))
    close(DecoderOps(triton=True).add_rms_norm(x, None, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [24, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_quantized_is_quantize_rows_of_the_norm(dtype: torch.dtype, width: int,
                                                             with_residual: bool) -> None:
    """The quantizing norm (one launch where the norm and fp8's quantization were two) writes the
    bits fp8.quantize_rows gives for the norm it computes, and the same residual; a zero row too."""
    gen = torch.Generator().manual_seed(width + with_residual)
    x = (4 * torch.randn(5, width, generator=gen)).to(dtype)
    x[3] = 0.0
    residual = torch.randn(5, width, generator=gen).to(dtype) if with_residual else None
    if residual is not None:
        residual[3] = 0.0
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    norm, res = fused_kernels.add_rms_norm(x, residual, weight, 1e-6)
    got, got_res = fused_kernels.add_rms_norm(x, residual, weight, 1e-6, quantize=True)
    assert isinstance(got, QuantizedRows) and got.q.dtype == FP8 and got.dtype == dtype
    want_q, want_scale = quantize_rows(norm)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(got_res, res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1500, 5000, SWIGLU_ROW_BLOCK + 700])
def test_silu_and_mul_quantized_is_quantize_rows_of_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    """SwiGLU into an FP8 projection: the bits fp8.quantize_rows gives for the kernel's own SwiGLU
    (rows held in one block, and a row wider than the block, read twice); a zero row's scale is the floor."""
    gen = torch.Generator().manual_seed(width)
    gate_up = (3 * torch.randn(3, 2 * width, generator=gen)).to(dtype)
    gate_up[1] = 0.0
    got = fused_kernels.silu_and_mul(gate_up, quantize=True)
    want_q, want_scale = quantize_rows(fused_kernels.silu_and_mul(gate_up))
    assert isinstance(got, QuantizedRows) and got.dtype == dtype
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_scale)


def test_decoder_ops_quantize_for_fp8_projections_only() -> None:
    gen = torch.Generator().manual_seed(11)
    x, r, w = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.ones(64)
    fp8_weight, bf16_weight = torch.zeros(8, 64, dtype=FP8), torch.zeros(8, 64)
    for ops in (DecoderOps(triton=False, fp8_path="reference"), DecoderOps(triton=True, fp8_path="reference")):
        norm, res = ops.add_rms_norm(x, r, w, 1e-6)
        plain, plain_res = ops.add_rms_norm(x, r, w, 1e-6, into=bf16_weight)
        quantized, quantized_res = ops.add_rms_norm(x, r, w, 1e-6, into=fp8_weight)
        assert torch.equal(plain, norm) and torch.equal(plain_res, res) and torch.equal(quantized_res, res)
        want_q, want_scale = quantize_rows(norm)
        assert torch.equal(quantized.q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(quantized.scale, want_scale)
        wq, ws = quantize_rows(torch.randn(8, 64, generator=gen))
        assert torch.equal(ops.linear(quantized, wq, ws.view(-1), None), ops.linear(norm, wq, ws.view(-1), None))
        gate_up = torch.randn(3, 128, generator=gen)
        act = ops.silu_and_mul(gate_up)
        assert torch.equal(ops.silu_and_mul(gate_up, into=bf16_weight), act)
        act_q = ops.silu_and_mul(gate_up, into=fp8_weight)
        assert torch.equal(act_q.q.view(torch.uint8), quantize_rows(act)[0].view(torch.uint8))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: a q/k norm in the rotary launch
def test_fp8_model_with_fused_ops_equals_its_reference_ops(arch, hf_checkpoints, make_llm) -> None:
    """A whole FP8 model: the norms quantize for qkv and gate/up, SwiGLU for down, in their kernels
    (QuantizedRows through the layer; one quantizing launch a layer, not four) and give the
    reference ops' logits, up to float32 sums in another order."""
    llm = make_llm(str(hf_checkpoints(arch)), quantization="fp8", device="cpu", num_blocks=16)
    runner = llm.engine.runner
    seqs = [ForwardSeq([3, 17, 42, 7, 99], 0, [0], 1), ForwardSeq([5, 6, 8], 0, [1], 1)]
    want = runner.forward_eager(seqs)
    runner.model.use_fused_ops(True)
    fp8 = runner.model.ops.fp8
    quantize, calls = fp8._quantize, []
    fp8._quantize = lambda rows: calls.append(rows.shape) or quantize(rows)
    try:
        got = runner.forward_eager(seqs)
    finally:
        runner.model.use_fused_ops(False)
    # Quantized apart: o_proj's input only (qkv's and gate/up's come from the norms, down's from SwiGLU).
    assert len(calls) == llm.engine.arch.num_layers
    assert got.shape == want.shape == (2, llm.engine.arch.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)  # 1.4e-6 apart on logits up to 10.7
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_stores_reciprocal_of_a_kv_scale_is_float32s() -> None:
    """The rotary kernel's store multiplies by 1 / scale as float32 divides (no host tensor a call)."""
    gen = torch.Generator().manual_seed(0)
    for scale in [0.75, 12.0, 1.25, 20.0, 3.0, 1e-3, 7.3, *(torch.rand(500, generator=gen) * 100 + 1e-3).tolist()]:
        want = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
        assert float32_reciprocal(scale) == want, scale


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_model_on_the_triton_path_stores_its_kv_in_the_rotary_launch(arch, hf_checkpoints, make_llm,
                                                                       monkeypatch) -> None:
    """The fused ops with the Triton backend (interpreted): the rotary kernel stores the step's K and V (no
    store_kv launch), and the logits and the cache equal the reference ops' on the torch backend. In a
    decode-only step of a model without q/k norms (llama) the decode launch rotates and stores instead: no
    rotary launch; with them (qwen3) a rotary launch a layer."""
    from engine.attention import triton_kernels
    from engine.attention.triton_backend import TritonAttention

    llm = make_llm(str(hf_checkpoints(arch)), device="cpu", num_blocks=16)
    runner = llm.engine.runner
    seqs = [ForwardSeq([3, 17, 42, 7, 99], 0, [0], 1), ForwardSeq([5, 6, 8], 0, [1], 1)]
    step = [ForwardSeq([11], 5, [0], 1)]  # one more token of the first sequence: a decode row
    want, want_step = runner.forward_eager(seqs), runner.forward_eager(step)
    want_kv = runner.kv_caches.clone()
    runner.kv_caches.zero_()
    stores: list[int] = []
    store_kv = triton_kernels.store_kv
    monkeypatch.setattr(triton_kernels, "store_kv", lambda *a, **kw: stores.append(1) or store_kv(*a, **kw))
    reference = runner.backend
    runner.backend = TritonAttention(reference.spec)
    runner.model.use_fused_ops(True)
    rotary: list[int] = []
    norm_rope_qk = fused_kernels.norm_rope_qk
    monkeypatch.setattr(fused_kernels, "norm_rope_qk", lambda *a, **kw: rotary.append(1) or norm_rope_qk(*a, **kw))
    try:
        got = runner.forward_eager(seqs)
        prompt_rotary, rotary[:] = len(rotary), []
        got_step = runner.forward_eager(step)
    finally:
        runner.model.use_fused_ops(False)
        runner.backend = reference
    assert stores == [], "the backend stored nothing: the rotary launch did"
    layers = llm.engine.arch.num_layers
    assert prompt_rotary == layers and len(rotary) == (layers if arch == "qwen3" else 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_step, want_step, atol=1e-4, rtol=1e-5)
    assert want_kv[..., 0, 5, :, :].abs().sum() > 0, "the decode row's K and V are in slot 5 of block 0"
    torch.testing.assert_close(runner.kv_caches, want_kv, atol=1e-5, rtol=1e-5)
