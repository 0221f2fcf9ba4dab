"""The Triton 4-bit kernel (engine/quant/int4_kernels.py) against the reference path under Triton's
CPU interpreter: group sizes that split a K tile or fill it, odd output counts, bias, 1-2 rows.
NOTE: imported under TRITON_INTERPRET (tests/interpreted.py says how, and why this skips otherwise)."""

from __future__ import annotations

import pytest
import torch

from engine.quant.int4 import Int4Matmul, pack_nibbles
from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

int4_kernels = import_interpreted("engine.quant.int4_kernels", "_small_matmul_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")


@pytest.mark.parametrize("rows, n, k, group", [(1, 48, 256, 128), (2, 40, 512, 128), (1, 17, 96, 32), (2, 8, 512, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_matmul_equals_reference_path(rows: int, n: int, k: int, group: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.stack((torch.rand(n, k // group, generator=gen).half() * 0.1,
                         torch.randint(0, 16, (n, k // group), generator=gen).half()), -1)
    b = torch.randn(n, generator=gen) if bias else None
    got = int4_kernels.small_matmul(x, pack_nibbles(q), scale, b)
    want = Int4Matmul("reference", triton=False)(x.double(), pack_nibbles(q), scale, b.double() if bias else None)
    # the kernel's float32 word sums keep about 20 bits of sum_k |x_k| 8 s_k (its terms' scale; the
    # kernel's docstring says why): within 2e-6 of it, where a bfloat16 output rounds at 4e-3
    term_scale = x.double().abs() @ (8 * scale[..., 0].double().repeat_interleave(group, 1)).T
    assert ((got.double() - want).abs() <= 2e-6 * term_scale).all()


@pytest.mark.parametrize("rows, n, k, group", [(3, 48, 256, 128), (33, 40, 512, 128), (20, 17, 96, 32)])
def test_tiled_matmul_equals_reference_path(rows: int, n: int, k: int, group: int) -> None:
    """The tensor-core kernel for more rows (float32 here: exact products, float32 sums)."""
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.stack((torch.rand(n, k // group, generator=gen).half() * 0.1,
                         torch.randint(0, 16, (n, k // group), generator=gen).half()), -1)
    b = torch.randn(n, generator=gen)
    got = int4_kernels.matmul(x, pack_nibbles(q), scale, b, (16, 32, 64, 4, 2))
    want = Int4Matmul("reference", triton=False)(x, pack_nibbles(q), scale, b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
