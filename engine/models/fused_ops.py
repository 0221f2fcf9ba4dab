"""The decoder's elementwise work, each op one Triton kernel on CUDA (one launch where eager PyTorch
spends 4-8), with the PyTorch reference beside it for the CPU and for tests.

Measured at the Qwen3-0.6B shape on one H100 (bench.profile_step): a batch-1 decode step was
~1,000 small kernels, ~3.8 ms on the device, of which ~2 ms were these ops unfused.

Every kernel rounds where transformers rounds, so outputs equal the reference's bit for bit in
float32 and up to the order of float32 sums otherwise:

- RMSNorm: normalize in float32, cast to the activations' dtype, then multiply by the weight
  (a product in the activations' dtype).
- add + RMSNorm: the residual sum is rounded to the dtype first (it is the next residual). Into
  an FP8 projection the norm leaves its kernel quantized, fp8.quantize_rows' bits of the rounded
  norm (QuantizedRows): the projection quantizes nothing, one launch less.
- rotary: x * cos and rotate_half(x) * sin each rounded, then their sum; cos/sin in the dtype.
  q's and k's heads (adjacent in qkv), each with its own q/k norm, in one launch.
- SwiGLU: silu(gate) rounded, times up; into an FP8 projection quantized in the same kernel, as
  the norm.

Layouts: rows are tokens; every last dimension is contiguous; q/k may be strided views of a fused
qkv projection.
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.models.rope import apply_rotary
from engine.quant.fp8 import FP8, Fp8Matmul, Fp8Path, QuantizedRows, quantize_rows
from engine.quant.int4 import Int4Matmul, Int4Path

HAS_TRITON = importlib.util.find_spec("triton") is not None


# ---- the PyTorch reference (transformers' order of operations)
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); without a residual (the first layer), (rms_norm(x), x)."""
    h = x if residual is None else residual + x
    return rms_norm_ref(h, weight, eps), h


def norm_rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Per-head RMSNorm (when weight is given; Qwen3's q/k norm), then rotary."""
    if weight is not None:
        x = rms_norm_ref(x, weight, eps)
    return apply_rotary(x, cos, sin)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * inter] (gate, then up) -> [tokens, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class KVStore(NamedTuple):
    """Where a step's new keys and values go: the paged caches at each token's slot (AttentionMetadata's
    slot_mapping: block * block_size + offset, < 0 for none), v's heads beside the rotated k's. A cache with
    scales holds K / k_scale and V / v_scale (engine/quant/kv_scales.py), each a product by the float32
    reciprocal rounded to the activations' dtype, as torch divides a CUDA tensor by a number."""

    v: torch.Tensor  # [tokens, kv heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def inverses(self) -> tuple[float, float]:
        """(1 / k_scale, 1 / v_scale) as the kernels that store multiply by them (`float32_reciprocal`)."""
        return float32_reciprocal(self.k_scale), float32_reciprocal(self.v_scale)


_F32 = struct.Struct("<f")


def _float32(x: float) -> float:
    return _F32.unpack(_F32.pack(x))[0]


@functools.cache
def float32_reciprocal(scale: float) -> float:
    """1 / scale in float32, as torch multiplies a CUDA tensor divided by a number (the quotient of two
    float32 values computed in double, then rounded once more: the float32 quotient)."""
    return _float32(1.0 / _float32(scale))


def takes_fp8(weight: torch.Tensor | None) -> bool:
    """Whether the projection of this weight takes its input quantized (an FP8 weight)."""
    return weight is not None and weight.dtype == FP8


def _for_projection(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor | QuantizedRows:
    """x as the projection of `weight` takes it: quantized for an FP8 one (the reference path's)."""
    return QuantizedRows(*quantize_rows(x), x.dtype) if takes_fp8(weight) else x


class DecoderOps:
    """The elementwise ops one model uses: Triton's on CUDA (when `triton` is true), else the reference."""

    def __init__(self, triton: bool, fp8_path: Fp8Path | None = None, int4_path: Int4Path | None = None) -> None:
        """fp8_path, int4_path: how FP8 and 4-bit projections multiply (None: the model has none)."""
        if triton and not HAS_TRITON:
            raise ValueError("fused Triton ops were asked for but triton is not installed; set fused_ops=False")
        self.triton = triton
        self.fp8 = Fp8Matmul(fp8_path, triton=triton) if fp8_path is not None else None
        self.int4 = Int4Matmul(int4_path, triton=triton) if int4_path is not None else None
        if triton:
            # NOTE: imported only here: importing triton decides, once per process, whether its
            # kernels are compiled or interpreted (TRITON_INTERPRET), which tests set later.
            from engine.models import fused_kernels, row_kernels

            self._kernels = fused_kernels
            self._rows = row_kernels

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """into: the weight of the projection the norm feeds; an FP8 one takes the norm quantized
        (QuantizedRows, in the norm's kernel on the Triton path: its quantization one launch less)."""
        if self.triton:
            return self._kernels.add_rms_norm(x, residual, weight, eps, takes_fp8(into))
        h, residual = add_rms_norm_ref(x, residual, weight, eps)
        return _for_projection(h, into), residual

    def norm_rope_qk(
        self, qk: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qk: q's heads then k's ([tokens, heads, head_dim], as in qkv) -> (q, k), each through
        norm_rope_ref with its own weight (one launch for both on the Triton path). store (the Triton path
        only): k and store.v into the paged caches in that launch, (q, None) returned."""
        if self.triton:
            return self._kernels.norm_rope_qk(qk, num_q_heads, cos, sin, q_weight, k_weight, eps, store)
        assert store is None, "the reference path leaves the store to the attention backend"
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        return norm_rope_ref(q, cos, sin, q_weight, eps), norm_rope_ref(k, cos, sin, k_weight, eps)

    def linear(self, x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor | None,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias; an FP8 or 4-bit (uint8) weight, with its scales, on its own path (an
        FP8 one may take its input quantized already: `add_rms_norm`'s `into`)."""
        if isinstance(x, QuantizedRows):
            assert self.fp8 is not None and weight.dtype == FP8, "quantized rows for a projection that is not FP8"
            return self.fp8(x, weight, weight_scale, bias)
        if weight_scale is None:
            if self.triton and self._rows.takes_row_product(x, weight):
                return self._rows.row_product(x, weight, bias)
            return F.linear(x, weight, bias)
        if weight.dtype == torch.uint8:
            assert self.int4 is not None, "a 4-bit weight in a model built without int4_path"
            return self.int4(x, weight, weight_scale, bias)
        assert self.fp8 is not None, "an FP8 weight in a model built without fp8_path"
        return self.fp8(x, weight, weight_scale, bias)

    def silu_and_mul(self, gate_up: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | QuantizedRows:
        """into: as `add_rms_norm`'s (the projection's weight; an FP8 one takes the product quantized)."""
        if self.triton:
            return self._kernels.silu_and_mul(gate_up, takes_fp8(into))
        return _for_projection(silu_and_mul_ref(gate_up), into)
