"""The Triton activation quantization (engine/quant/fp8_kernels.py) equals `fp8.quantize_rows` bit
for bit under Triton's CPU interpreter: values over ten decades (E4M3 subnormals included), odd
widths, a zero row, float32/float16/bfloat16 inputs, a strided view, a row in chunks; the split-K
product equals the reference path's float32 sums, and its configuration rule. NOTE: imported under
TRITON_INTERPRET (tests/interpreted.py says how, and why this skips otherwise)."""

from __future__ import annotations

import pytest
import torch

from engine.quant.fp8 import Fp8Matmul, quantize_rows
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

fp8_kernels = import_interpreted("engine.quant.fp8_kernels", "_quantize_rows_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [7, 100, 4096])
def test_kernel_equals_reference_bit_for_bit(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    magnitudes = torch.logspace(-8 if dtype != torch.float16 else -4, 2, width)
    x = (torch.randn(4, width, generator=gen) * magnitudes[torch.randperm(width, generator=gen)]).to(dtype)
    x[2] = 0.0
    q, scale = fp8_kernels.quantize_rows(x)
    want_q, want_scale = quantize_rows(x)
    assert q.dtype == want_q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert not q[2].float().any()
    # subnormal E4M3 codes (exponent field 0) were exercised
    assert ((q.view(torch.uint8) & 0x78) == 0).logical_and(q.float() != 0).any() or width == 7


def test_kernel_reads_a_strided_view() -> None:
    whole = torch.randn(3, 96)
    view = whole[:, 16:80]  # rows 96 apart, 64 wide
    q, scale = fp8_kernels.quantize_rows(view)
    want_q, want_scale = quantize_rows(view.contiguous())
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_chunked_rows_equal_reference_bit_for_bit() -> None:
    """One long row spread over chunks (the last one partial) quantizes as one program would."""
    x = torch.randn(2, 2500) * torch.logspace(-3, 1, 2500)
    q, scale = fp8_kernels.quantize_rows(x)
    want_q, want_scale = quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("rows, n, k, config", [
    (1, 48, 300, (16, 32, 64, 2, 4, 2)),     # K not a multiple of its slices; N of the tile
    (20, 100, 1024, (16, 64, 128, 4, 4, 2)),  # two m-blocks
    (5, 40, 520, (16, 32, 128, 1, 4, 2)),     # one slice: scales and bias in the product's epilogue
    (3, 64, 640, (16, 64, 128, 8, 4, 2)),     # eight splits asked, five slices of 128 left
])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_matmul_equals_reference_path(rows: int, n: int, k: int, config: tuple, bias: bool) -> None:
    """The tensor-core product of quantized rows: float32 sums in another order."""
    gen = torch.Generator().manual_seed(rows * n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    wq, ws = quantize_rows(w)
    xq, xs = fp8_kernels.quantize_rows(x)
    got = fp8_kernels.split_k_matmul(xq, xs, wq, ws.view(-1), b, torch.float32, config=config)
    want = Fp8Matmul("reference", triton=False)(x, wq, ws.view(-1), b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_split_k_sums_every_slice_once_in_order_and_leaves_the_counts_zeroed(bias: bool) -> None:
    """One launch: the tile's last slice adds the slices in split order, so the product equals each
    slice's product alone (one slice, the same K tiles) summed in that order, bit for bit; and
    the counts it used are zero again for the next launch (a CUDA graph replays the same buffer)."""
    gen = torch.Generator().manual_seed(7)
    rows, n, k, block_k, splits = 3, 80, 512, 128, 4
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    wq, ws = quantize_rows(w)
    xq, xs = fp8_kernels.quantize_rows(x)
    counts = fp8_kernels.split_k_counts(torch.device("cpu"))
    got = fp8_kernels.split_k_matmul(xq, xs, wq, ws.view(-1), b, torch.float32, counts, (16, 32, block_k, splits, 4, 2))
    assert not counts.any()
    width = k // splits
    want = torch.zeros(rows, n)
    for s in range(splits):
        cols = slice(s * width, (s + 1) * width)
        want += fp8_kernels.split_k_matmul(xq[:, cols].contiguous(), xs, wq[:, cols].contiguous(), ws.view(-1), None,
                                           torch.float32, counts, (16, 32, block_k, 1, 4, 2))
    if b is not None:
        want += b
    assert torch.equal(got, want)
    config = (16, 32, block_k, splits, 4, 2)
    again = fp8_kernels.split_k_matmul(xq, xs, wq, ws.view(-1), b, torch.float32, counts, config)
    assert torch.equal(again, got)


@pytest.mark.parametrize("n, k, config", [
    (48, 300, (8, 128, 4, 2)),     # K not a multiple of its steps
    (45, 520, (16, 256, 4, 2)),    # N not a multiple of the tile
    (64, 2048, None),              # gemv_config's tiles (1024-column steps)
    (4104, 1024, None),            # past 4096 rows: 512-column steps
])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matmul_equals_reference_path(n: int, k: int, config: tuple | None, bias: bool) -> None:
    """One row on the CUDA cores: E4M3 products exact in float32, the sums in another order."""
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    wq, ws = quantize_rows(w)
    xq, xs = fp8_kernels.quantize_rows(x)
    got = fp8_kernels.gemv_matmul(xq, xs, wq, ws.view(-1), b, torch.float32, config)
    want = Fp8Matmul("reference", triton=False)(x, wq, ws.view(-1), b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="one row; got 2"):
        fp8_kernels.gemv_matmul(torch.cat([xq, xq]), xs, wq, ws.view(-1), b, torch.float32, config)


def test_fp8_matmul_takes_one_row_to_the_gemv_and_more_to_split_k() -> None:
    """Fp8Matmul's one-row product is gemv_matmul's, bit for bit; two rows take split_k_matmul's tiles."""
    gen = torch.Generator().manual_seed(4)
    served = Fp8Matmul("cuda", triton=True)
    x, w = torch.randn(2, 512, generator=gen), torch.randn(40, 512, generator=gen)
    wq, ws = quantize_rows(w)
    xq, xs = fp8_kernels.quantize_rows(x)
    one = served(x[:1], wq, ws.view(-1), None)
    assert torch.equal(one, fp8_kernels.gemv_matmul(xq[:1], xs[:1], wq, ws.view(-1), None, torch.float32))
    two = served(x, wq, ws.view(-1), None)
    assert torch.equal(two, fp8_kernels.split_k_matmul(xq, xs, wq, ws.view(-1), None, torch.float32))


def test_fp8_matmul_shares_one_count_buffer_across_its_products() -> None:
    """The served path's products of a few rows (interpreted here on CPU tensors) reuse one zeroed
    count buffer a device, whatever their shapes."""
    gen = torch.Generator().manual_seed(3)
    served, reference = Fp8Matmul("cuda", triton=True), Fp8Matmul("reference", triton=False)
    for rows, n, k in [(3, 96, 1024), (1, 40, 2048), (20, 64, 512)]:
        x = torch.randn(rows, k, generator=gen)
        wq, ws = quantize_rows(torch.randn(n, k, generator=gen))
        torch.testing.assert_close(served(x, wq, ws.view(-1), None), reference(x, wq, ws.view(-1), None),
                                   atol=1e-4, rtol=1e-5)
    assert list(served._counts) == [torch.device("cpu")] and not served._counts[torch.device("cpu")].any()


def test_split_k_refuses_more_tiles_than_its_counts() -> None:
    n, k = fp8_kernels.MAX_TILES * 16 + 16, 128
    wq = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    xq, xs = fp8_kernels.quantize_rows(torch.ones(1, k))
    with pytest.raises(ValueError, match=f"tiles; at most {fp8_kernels.MAX_TILES}"):
        fp8_kernels.split_k_matmul(xq, xs, wq, torch.ones(n), None, torch.float32, config=(16, 16, 128, 2, 4, 2))


@pytest.mark.parametrize("m, k, n", [(1, 4096, 6144), (1, 28672, 8192), (16, 4096, 28672), (32, 8192, 8192),
                                     (64, 14336, 4096), (3, 256, 64)])
def test_split_k_config_streams_the_weights(m: int, k: int, n: int) -> None:
    """Tiles of at most 32 rows (exact float32 sums), enough programs for every SM unless the
    slices would drop under four K tiles, and no slice split off past K."""
    block_m, block_n, block_k, split, _, _ = fp8_kernels.split_k_config(m, k, n)
    assert block_m in (16, 32) and block_m >= min(m, 32)
    programs = -(-n // block_n) * split
    assert programs * block_m >= fp8_kernels.SPLIT_K_TILE_ROWS or k // (2 * split) < 4 * block_k
    assert k // split >= block_k or split == 1
