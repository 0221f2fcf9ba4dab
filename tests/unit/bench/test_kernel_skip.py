"""bench.diag.kernel_skip on the CPU: a skipped launcher launches no kernel and returns what its callers take
(the shapes, dtypes and types of the outputs it leaves unwritten); no setting skips nothing."""

from __future__ import annotations

import pytest
import torch

from bench.diag import kernel_skip
from engine.quant.fp8 import FP8, QuantizedRows
from tests.interpreted import import_interpreted


def test_skipped_launchers_return_their_outputs_unwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    fused = import_interpreted("engine.models.fused_kernels", "_norm_rope_kernel")
    fp8_kernels = import_interpreted("engine.quant.fp8_kernels", "_quantize_rows_kernel")
    launchers = [(fused, "norm_rope_qk"), (fused, "silu_and_mul"), (fp8_kernels, "quantize_rows")]
    originals = [getattr(module, name) for module, name in launchers]
    for module, name in launchers:
        monkeypatch.setattr(module, name, getattr(module, name))  # NOTE: put back after the test
    kernel_skip.skip(set())
    assert [getattr(module, name) for module, name in launchers] == originals
    kernel_skip.skip({"rope", "quantize", "swiglu"})
    assert all(getattr(module, name) is not original for (module, name), original in zip(launchers, originals))
    launched: list[str] = []
    for module, name in [(fused, "_norm_rope_kernel"), (fused, "_silu_and_mul_quantized_kernel"),
                         (fp8_kernels, "_quantize_rows_kernel")]:
        monkeypatch.setattr(module, name, type("Launch", (), {"__getitem__": lambda self, grid: launched.append}))
    qk = torch.randn(3, 6, 16)
    q, k = fused.norm_rope_qk(qk, 4, None, None, None, None, 1e-6)
    assert q.shape == (3, 4, 16) and q.data_ptr() == qk.data_ptr() and k.shape == (3, 2, 16)
    assert fused.norm_rope_qk(qk, 4, None, None, None, None, 1e-6, store=object())[1] is None
    xq, scale = fp8_kernels.quantize_rows(torch.randn(2, 64))
    assert xq.shape == (2, 64) and xq.dtype == FP8 and scale.shape == (2, 1)
    h = fused.silu_and_mul(torch.randn(1, 96, dtype=torch.bfloat16), True)
    assert isinstance(h, QuantizedRows) and h.q.shape == (1, 48) and h.dtype == torch.bfloat16
    assert fused.silu_and_mul(torch.randn(2, 96), False).shape == (2, 48)
    assert launched == []
