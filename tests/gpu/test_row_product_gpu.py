"""The one-row product (engine/models/row_kernels.py) compiled on a GPU: the routing rule, its sums against
float64's at the Llama-3.1-8B TP=1 and TP=2 projections, the 70B TP=2 ones (the long rows' tile) and an LM head's
shard, and DecoderOps sending one row there."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("n, k", [(4096, 2048), (4096, 4096), (4096, 7168), (4096, 14336), (3072, 4096),
                                  (14336, 4096), (5120, 8192), (8192, 14336), (64128, 4096)])
def test_row_product_equals_float64_within_rounding(n: int, k: int) -> None:
    from engine.models import row_kernels

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    assert row_kernels.takes_row_product(x, w)
    want = x.double() @ w.double().t()
    got = row_kernels.row_product(x, w, None)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)


def test_decoder_ops_take_one_row_there_and_leave_two_to_cublas() -> None:
    from engine.models import row_kernels
    from engine.models.fused_ops import DecoderOps

    ops = DecoderOps(triton=True)
    x = torch.randn(2, 4096, device="cuda").bfloat16()
    w = torch.randn(8192, 4096, device="cuda").bfloat16()
    assert torch.equal(ops.linear(x[:1], w, None, None), row_kernels.row_product(x[:1], w, None))
    assert not row_kernels.takes_row_product(x, w) and not row_kernels.takes_row_product(x[:1].float(), w)
    assert torch.equal(ops.linear(x, w, None, None), torch.nn.functional.linear(x, w))
