"""The Triton 4-bit kernel (engine/quant/int4_kernels.py) against the reference path under Triton's
CPU interpreter, on float16 rows (the interpreter multiplies bfloat16 as their bits): groups under,
at and over a 128-column trip, tiles of 128, 64, 32 and 16 rows, row tiles of 16, 32 and 64, K split and not,
bias; the dequantization past its rows. Its PTX conversion runs on a GPU only (tests/gpu/test_quant_gpu.py); the
interpreter runs the same numbers in Triton's operations. NOTE: imported under TRITON_INTERPRET (tests/interpreted.py
says how, and why this skips otherwise)."""

from __future__ import annotations

import pytest
import torch

from engine.quant.int4 import Int4Matmul, dequantize, pack_nibbles, to_words, words_block_n
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

int4_kernels = import_interpreted("engine.quant.int4_kernels", "_words_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")


def _case(rows: int, n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).half()
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.stack((torch.rand(n, k // group, generator=gen).half() * 0.1,
                         torch.randint(0, 16, (n, k // group), generator=gen).half()), -1)
    return x, pack_nibbles(q), scale


@pytest.mark.parametrize("rows, n, k, group, bias", [
    (1, 64, 512, 128, False),  # K split in two
    (3, 48, 384, 32, True),  # tiles of 16 rows; four groups a trip
    (17, 32, 256, 64, False),  # 32-row tile; two groups a trip
    (2, 64, 512, 256, True),  # a group over two trips
    (40, 64, 128, 16, True),  # a 64-row tile; eight groups a trip
    (1, 128, 512, 128, True),  # tiles of 128 rows, K split in two
    (40, 256, 256, 32, False),  # two 128-row tiles against a 64-row tile
])
def test_words_matmul_equals_reference_path(rows: int, n: int, k: int, group: int, bias: bool) -> None:
    x, weight, scale = _case(rows, n, k, group, seed=rows * n + k)
    b = torch.randn(n).half() if bias else None
    want = Int4Matmul("reference", triton=False)(x.double(), weight, scale, b.double() if bias else None)
    block_n = words_block_n(weight, scale)
    assert block_n == max(b for b in (128, 64, 32, 16) if n % b == 0)
    assert (int4_kernels.words_config(rows, n, k, block_n, None)[1] > 1) == (k == 512)
    counts = int4_kernels.split_k_counts(torch.device("cpu"))
    got = int4_kernels.words_matmul(x, *to_words(weight, scale, block_n), b, block_n, counts)
    # exact products of (q - z) and x summed in float32, scaled in float32, rounded to float16 once
    term_scale = x.double().abs() @ (16 * scale[..., 0].double().repeat_interleave(group, 1)).T
    assert ((got.double() - want).abs() <= 2**-10 * want.abs() + 1e-6 * term_scale + 1e-6).all()
    assert not counts.any()  # each launch leaves the split-K counts zeroed


def test_the_words_layout_refuses_scales_the_kernel_cannot_read_as_words() -> None:
    """The kernel reads a row's (scale, zero point) as one 32-bit word: to_words, which lays the scales out for
    it (contiguous), refuses other than float16 pairs."""
    _, weight, scale = _case(1, 64, 256, 128, seed=5)
    assert to_words(weight, scale, 64)[1].is_contiguous()
    with pytest.raises(ValueError, match="weight_scale must be float16"):
        to_words(weight, scale.to(torch.bfloat16), 64)


def test_words_config_splits_k_for_few_tiles_only() -> None:
    assert int4_kernels.words_config(1, 64, 512, 64, None) == (16, 2)  # one tile: K split while slices keep 2 trips
    assert int4_kernels.words_config(1, 64, 256, 64, None) == (16, 1)
    assert int4_kernels.words_config(1, 4096, 4096, 64, None)[1] == 8  # 64 tiles: split to 512 programs
    assert int4_kernels.words_config(1, 28672, 4096, 64, None)[1] == 2
    assert int4_kernels.words_config(40, 4096, 4096, 64, None) == (64, 4)  # half the programs from 33 rows
    # tiles of 128 rows: half as many programs (the same rows times slices)
    assert int4_kernels.words_config(1, 4096, 4096, 128, None)[1] == 8
    assert int4_kernels.words_config(1, 28672, 4096, 128, None)[1] == 2
    assert int4_kernels.words_config(40, 4096, 4096, 128, None) == (64, 4)
    # the SMs' last round of programs: up to 8 rows K splits once more where that round was 10% emptier
    assert int4_kernels.words_config(1, 28672, 4096, 128, 132) == (16, 4)  # 448 programs idle 18%, 896 3%
    assert int4_kernels.words_config(8, 28672, 4096, 128, 132) == (16, 4)
    assert int4_kernels.words_config(9, 28672, 4096, 128, 132) == (16, 2)  # past 8 rows: the target alone
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):  # 384 or 256 programs: idle 3% already
        assert int4_kernels.words_config(1, n, k, 128, 132) == int4_kernels.words_config(1, n, k, 128, None)
    with pytest.raises(ValueError, match="WORDS_MAX_ROWS"):
        int4_kernels.words_matmul(torch.zeros(65, 128).half(), *_case(1, 16, 128, 128, 0)[1:], None, 16,
                                  int4_kernels.split_k_counts(torch.device("cpu")))


def test_int4_matmul_takes_the_kernel_where_the_layout_does() -> None:
    """On the cuda path with Triton (run here on CPU tensors, interpreted), a projection in to_words'
    layout goes through the kernel; one whose K is no multiple of 128 stays in bytes and is
    dequantized and multiplied."""
    matmul = Int4Matmul("cuda", triton=True)
    assert matmul.words
    for k in (256, 64):
        x, weight, scale = _case(2, 32, k, 32, seed=k)
        want = Int4Matmul("reference", triton=False)(x.double(), weight, scale, None)
        block_n = words_block_n(weight, scale)
        assert (block_n is None) == (k == 64)
        held = to_words(weight, scale, block_n) if block_n else (weight, scale)
        torch.testing.assert_close(matmul(x, *held, None).double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("n, k, group", [(64, 256, 128), (48, 384, 32), (32, 512, 256), (64, 128, 16)])
def test_dequantize_words_equals_dequantize(n: int, k: int, group: int) -> None:
    """The kernel Int4Matmul dequantizes with past WORDS_MAX_ROWS rows: int4.dequantize's numbers, bit for bit."""
    _, weight, scale = _case(1, n, k, group, seed=n + k)
    block_n = words_block_n(weight, scale)
    got = int4_kernels.dequantize_words(*to_words(weight, scale, block_n), torch.float16, block_n)
    assert torch.equal(got, dequantize(weight, scale, torch.float16))
    rows = torch.randn(int4_kernels.WORDS_MAX_ROWS + 1, k).half()
    torch.testing.assert_close(Int4Matmul("cuda", triton=True)(rows, *to_words(weight, scale, block_n), None),
                               rows @ got.T)


def test_awq_model_in_the_words_layout_is_as_close_as_its_reference_ops(make_llm, tmp_path) -> None:
    """A whole 4-bit model (every projection K = 128 or 256, groups of 32) moved to the words layout and
    run on the kernels (interpreted, float16; 8 rows take the words kernel, 72 the dequantization) is as
    close to the float32 model's logits as the float16 reference path is (float16 activations move both
    about 1% of the logits' scale, after two layers). Moved back, its bytes and logits are the reference's."""
    from engine.runner import ForwardSeq
    from tests.builders import make_hf_checkpoint
    from tests.quant_builders import write_int4

    import_interpreted("engine.models.fused_kernels", "_add_rms_norm_kernel")
    src = make_hf_checkpoint("qwen2", tmp_path / "src", hidden_size=128, intermediate_size=256, head_dim=32)
    write_int4(src, tmp_path / "awq", group=32)
    batches = [[ForwardSeq([3, 17, 42, 7, 99], 0, [0], 1), ForwardSeq([5, 6, 8], 0, [1], 1)],
               [ForwardSeq(list(range(1, 73)), 0, [0, 1, 2, 3, 4], 1)]]
    truth = [make_llm(str(tmp_path / "awq"), dtype="float32", num_blocks=16).engine.runner.forward_eager(b).float()
             for b in batches]
    runner = make_llm(str(tmp_path / "awq"), dtype="float16", num_blocks=16).engine.runner
    reference = [runner.forward_eager(b) for b in batches]
    model = runner.model
    model.int4_path = "cuda"  # NOTE: the CUDA path's kernels, interpreted on CPU tensors
    model.use_fused_ops(True)
    try:
        assert model.int4_words and model.ops.int4.words
        words = [runner.forward_eager(b) for b in batches]
    finally:
        model.use_fused_ops(False)
        model.int4_path = "reference"
    for w, r, t in zip(words, reference, truth):
        w_err, r_err = (w.float() - t).abs(), (r.float() - t).abs()
        assert 0 < r_err.max() < 0.02 * t.abs().max()
        assert w_err.max() <= 1.5 * r_err.max() and w_err.mean() <= 1.5 * r_err.mean()
    assert not model.int4_words
    assert torch.equal(runner.forward_eager(batches[0]), reference[0])
