"""The one-row product on the CUDA cores (engine/models/row_kernels.py) under Triton's CPU interpreter: it equals
the float32 reference's sums (another order) at widths that do not fill its tiles, with and without a bias, and
refuses more than one row; the routing rule takes no CPU tensor. NOTE: imported under TRITON_INTERPRET
(tests/interpreted.py says how, and why this skips otherwise)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

row_kernels = import_interpreted("engine.models.row_kernels", "_row_product_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")


@pytest.mark.parametrize("n, k, config", [
    (45, 300, (8, 128, 4, 2)),    # N and K not multiples of the tile
    (64, 2048, None),             # the served tile
    (16, 1000, (16, 256, 4, 3)),
    (12, 8200, None),             # long rows: row_config's wider tile, K not a multiple of it
])
@pytest.mark.parametrize("bias", [False, True])
def test_row_product_equals_the_float32_reference(n: int, k: int, config: tuple | None, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = row_kernels.row_product(x, w, b, config)
    want = x.double() @ w.double().t() + (b.double() if bias else 0.0)
    assert got.shape == (1, n)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    assert row_kernels.row_product(x[0], w, b, config).shape == (n,)  # no batch dimension


def test_row_product_refuses_two_rows() -> None:
    with pytest.raises(ValueError, match="one row of 64; got x of shape"):
        row_kernels.row_product(torch.randn(2, 64), torch.randn(8, 64), None)


def test_a_push_is_refused_past_its_region_or_for_a_part_tile() -> None:
    push = row_kernels.Push(0, torch.zeros(1, dtype=torch.int32), 64, 0, 2)
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pushes 16-bit rows of a multiple of 8 up to 64 values; got 45"):
        row_kernels.row_product(x, torch.randn(45, 32, dtype=torch.bfloat16), None, push=push)
    with pytest.raises(ValueError, match="got 72"):
        row_kernels.row_product(x, torch.randn(72, 32, dtype=torch.bfloat16), None, push=push)
    with pytest.raises(ValueError, match="got 64 of torch.float32"):
        row_kernels.row_product(x.float(), torch.randn(64, 32), None, push=push)


def test_long_rows_take_the_wider_tile() -> None:
    assert row_kernels.row_config(4096) == row_kernels.ROW_CONFIG
    assert row_kernels.row_config(8192) == row_kernels.row_config(14336) == row_kernels.LONG_ROW_CONFIG


def test_the_rule_takes_no_cpu_tensor() -> None:
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    assert not row_kernels.takes_row_product(x, w)
