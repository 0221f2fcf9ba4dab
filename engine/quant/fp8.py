"""FP8 (E4M3) W8A8 linears: per-output-channel weight scales, dynamic per-token activation scales.

A quantized linear holds `weight` [out, in] float8_e4m3fn and `weight_scale` [out] float32, with
weight ~= weight.float() * weight_scale[:, None]. Its input is quantized row by row as it arrives
(`quantize_rows`: scale = max|row| / 448, values times its float32 reciprocal, rounded to nearest
even), or arrives quantized so by the kernel before it (`QuantizedRows`: the RMSNorm or SwiGLU of
engine/models/fused_ops.py), and

    y = (x_q @ weight.T) * x_scale * weight_scale (+ bias)

with float32 accumulation. Two paths compute it: `cuda` (CUDA with compute capability 8.9+ and
bfloat16 activations: the Triton quantization, then one row a Triton product on the CUDA cores, up to
fp8_kernels.SPLIT_K_MAX_ROWS rows a Triton split-K tensor-core product, more rows torch._scaled_mm with
row-wise scales) and
`reference` (everywhere else: the same quantized operands multiplied in float32, slowly). Knows
nothing of checkpoints (checkpoint.py) or of which modules are quantized (convert.py).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-10
"""The smallest scale: an all-zero row quantizes to zeros instead of dividing by zero."""

Fp8Path = Literal["cuda", "reference"]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, n] -> (q [rows, n] float8_e4m3fn, scale [rows, 1] float32), q * scale ~= x.
    The rounding every path shares (the Triton kernel equals it bit for bit). Values are multiplied
    by the scale's reciprocal (one correctly rounded float32 product, as vLLM's kernels do), which
    costs a kernel less than a correctly rounded division per value."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class QuantizedRows(NamedTuple):
    """A projection's input already quantized as `quantize_rows` does (by the kernel that made it:
    the RMSNorm before the projection), and the dtype the product returns."""

    q: torch.Tensor  # [rows, n] float8_e4m3fn
    scale: torch.Tensor  # [rows, 1] float32
    dtype: torch.dtype


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [rows, n] with scale [rows] or [rows, 1] -> q * scale in `dtype` (references, tests)."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def fp8_path(device: torch.device, dtype: torch.dtype) -> Fp8Path:
    """The path a model on `device` with activations of `dtype` runs."""
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 9):
        return "cuda"
    return "reference"


class Fp8Matmul:
    """y = x @ W.T for FP8 weights, on one path; `triton`: the Triton kernels (CUDA) where they serve:
    the activation quantization, and the product of one row and of a few rows."""

    def __init__(self, path: Fp8Path, triton: bool) -> None:
        self.path = path
        self._quantize = quantize_rows
        self._split_k_matmul = None
        self._gemv_matmul = None
        self._split_k_max_rows = 0
        self._split_k_counts = None
        # NOTE: one count buffer a device for all of a model's products: they run one after another
        # on its stream, and each leaves the counts zeroed.
        self._counts: dict[torch.device, torch.Tensor] = {}
        if triton:
            from engine.quant import fp8_kernels  # NOTE: imports triton; only CUDA models (and interpreted tests) do

            self._quantize = fp8_kernels.quantize_rows
            if path == "cuda":
                self._split_k_matmul, self._gemv_matmul = fp8_kernels.split_k_matmul, fp8_kernels.gemv_matmul
                self._split_k_max_rows = fp8_kernels.SPLIT_K_MAX_ROWS
                self._split_k_counts = fp8_kernels.split_k_counts

    def __call__(self, x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype; QuantizedRows [rows, in] -> [rows, out] in its dtype."""
        if isinstance(x, QuantizedRows):
            (x_q, x_scale, dtype), lead = x, x.q.shape[:-1]
        else:
            x_q, x_scale = self._quantize(x.reshape(-1, x.shape[-1]))
            dtype, lead = x.dtype, x.shape[:-1]
        device = x_q.device
        if self._gemv_matmul is not None and x_q.shape[0] == 1:
            out = self._gemv_matmul(x_q, x_scale, weight, weight_scale, bias, dtype)
        elif self._split_k_matmul is not None and x_q.shape[0] <= self._split_k_max_rows:
            if device not in self._counts:
                self._counts[device] = self._split_k_counts(device)
            out = self._split_k_matmul(x_q, x_scale, weight, weight_scale, bias, dtype, self._counts[device])
        elif self.path == "cuda":
            # NOTE: weight.t() of a row-major [out, in] tensor is the column-major operand cuBLASLt wants
            out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                   bias=bias, out_dtype=dtype)
        else:
            out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.view(1, -1)
            out = (out if bias is None else out + bias.float()).to(dtype)
        return out.reshape(*lead, weight.shape[0])
