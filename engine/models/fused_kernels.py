"""The Triton kernels behind `fused_ops.DecoderOps` (its docstring says what each rounds where);
imported only when a model on CUDA (or a TRITON_INTERPRET test) asks for them."""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import to_cache
from engine.models.fused_ops import KVStore
from engine.pdl import after_previous, pdl_options
from engine.quant.fp8 import FP8, QuantizedRows
from engine.quant.fp8_kernels import quantize_row, row_scale, to_e4m3



@triton.jit
def norm_row(h, w, out_ptr, scale_ptr, row, stride_o, cols, ok, n, eps, QUANTIZE: tl.constexpr):
    """h: one row in the activations' dtype, w: the norm's weight (float32, loaded before the kernel's wait:
    no kernel writes it) -> out's row = weight * norm(h) in that dtype; with QUANTIZE, that quantized as
    fp8.quantize_rows does (E4M3 into out, the row's scale into scale_ptr). The norm of `_add_rms_norm_kernel`
    and of the symmetric all-reduce's fused kernel (engine/parallel/symm_kernels.py)."""
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    y = (hf * inv).to(h.dtype).to(tl.float32)
    if QUANTIZE:
        q, scale = quantize_row((w * y).to(h.dtype).to(tl.float32), ok)
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, stride_x, stride_r, stride_o, stride_ro, n, eps,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program a row: h = residual + x (rounded; stored as the new residual), out = norm(h) in
    the activations' dtype; with QUANTIZE, out is that norm quantized as fp8.quantize_rows does
    (E4M3 into out, the row's scale into scale_ptr): the next projection's input, one launch less."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # NOTE: a weight: read before the wait
    after_previous(PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, h, mask=ok)
    norm_row(h, w, out_ptr, scale_ptr, row, stride_o, cols, ok, n, eps, QUANTIZE)

@triton.jit
def _norm_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, q_out_ptr, k_out_ptr, stride_xt, stride_xh, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_c, eps, num_q_heads, num_heads,
    v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh, stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch, num_kv_heads, k_inverse, v_inverse,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
    STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (tokens, cdiv(q heads + k heads (+ v heads: STORE), BLOCK_H)): BLOCK_H heads of one token, each
    normalized (HAS_NORM: q's or k's weight) then rotated, into q_out or k_out. q and k in one launch (they are
    adjacent in qkv). STORE: k's heads and v's (v_ptr) go into the paged caches at the token's slot instead
    (store_kv's layout and rounding; a slot < 0 stores nothing), each first times its scale's reciprocal and
    rounded (1.0: unchanged), not into k_out. NOTE: BLOCK_H heads a program, not one: a program per head was a
    launch of tokens x 40 one-warp programs at the 8B shape, 387 us for 8,192 tokens
    (bench/results/profile_step_8b_prompt_steps_*)."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_q = h < num_q_heads
    q_rows = (is_q & (h < num_heads))[:, None]
    k_rows = ((h >= num_q_heads) & (h < num_heads))[:, None]
    d = tl.arange(0, HALF)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d
    x1 = tl.load(src, mask=q_rows | k_rows, other=0.0)
    x2 = tl.load(src + HALF, mask=q_rows | k_rows, other=0.0)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)
        w1 = tl.where(is_q[:, None], tl.load(wq_ptr + d), tl.load(wk_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q[:, None], tl.load(wq_ptr + HALF + d), tl.load(wk_ptr + HALF + d)).to(tl.float32)
        x1 = (w1 * (f1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (f2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype)
    c1 = tl.load(cos_ptr + t * stride_c + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + d).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    q_dst = q_out_ptr + t * stride_qt + h[:, None] * stride_qh + d
    tl.store(q_dst, o1, mask=q_rows)
    tl.store(q_dst + HALF, o2, mask=q_rows)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        stored = (tl.zeros([BLOCK_H, 1], dtype=tl.int64) + slot) >= 0
        k_dst = kc_ptr + block * stride_kcb + offset * stride_kco + (h - num_q_heads)[:, None] * stride_kch + d
        tl.store(k_dst, to_cache((o1.to(tl.float32) * k_inverse).to(dtype), kc_ptr), mask=k_rows & stored)
        tl.store(k_dst + HALF, to_cache((o2.to(tl.float32) * k_inverse).to(dtype), kc_ptr), mask=k_rows & stored)
        vh = (h - num_heads)[:, None]
        v_rows = (vh >= 0) & (vh < num_kv_heads) & stored
        v_src = v_ptr + t * stride_vt + vh * stride_vh + d
        v_dst = vc_ptr + block * stride_vcb + offset * stride_vco + vh * stride_vch + d
        v1 = tl.load(v_src, mask=v_rows, other=0.0).to(tl.float32) * v_inverse
        v2 = tl.load(v_src + HALF, mask=v_rows, other=0.0).to(tl.float32) * v_inverse
        tl.store(v_dst, to_cache(v1.to(dtype), vc_ptr), mask=v_rows)
        tl.store(v_dst + HALF, to_cache(v2.to(dtype), vc_ptr), mask=v_rows)
    else:
        k_dst = k_out_ptr + t * stride_kt + (h - num_q_heads)[:, None] * stride_kh + d
        tl.store(k_dst, o1, mask=k_rows)
        tl.store(k_dst + HALF, o2, mask=k_rows)


NORM_ROPE_HEADS = 8
"""Heads a program of `_norm_rope_kernel` rotates (2 warps: 8 elements a thread a half at head_dim 128)."""


@triton.jit
def _swiglu(row_ptr, cols, n):
    """silu(gate) rounded to the activations' dtype, times up, rounded: columns `cols` (< n) of the
    row [gate (n), up (n)] at row_ptr, in the activations' dtype."""
    ok = cols < n
    g = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(row_ptr + n + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = row_ptr.dtype.element_ty
    return ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (tokens, cdiv(n, BLOCK)): out = silu(gate) (rounded) * up."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, _swiglu(x_ptr + row * stride_x, cols, n), mask=cols < n)


@triton.jit
def _silu_and_mul_quantized_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n, BLOCK: tl.constexpr,
                                   ONE_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Grid (tokens,): the row's silu(gate) (rounded) * up, rounded to the activations' dtype, as
    `_silu_and_mul_kernel` computes it, quantized as fp8.quantize_rows does. ONE_BLOCK (n <= BLOCK):
    the row read once and held while its max is found; else a pass for the row's max, then the same
    values again, quantized (recomputed rather than stored: no scratch row)."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        q, scale = quantize_row(_swiglu(x_row, cols, n).to(tl.float32), cols < n)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, n, BLOCK):
            amax = tl.maximum(amax, tl.where(k0 + cols < n, tl.abs(_swiglu(x_row, k0 + cols, n).to(tl.float32)), 0.0))
        scale = row_scale(tl.max(amax, 0))
        inverse = tl.math.div_rn(1.0, scale)
        for k0 in range(0, n, BLOCK):
            q = to_e4m3(_swiglu(x_row, k0 + cols, n).to(tl.float32), inverse)
            tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < n)
    tl.store(scale_ptr + row, scale)


SWIGLU_ROW_BLOCK = 16384
"""The widest SwiGLU row `silu_and_mul(quantize=True)` holds in one program (16 warps: 32 columns a
thread); Llama-3.1-8B's 14,336 fit. A row is one program (its scale needs the whole row), so at one
row a step the kernel's time is one program's: read once, not twice in chunks
(bench/results/profile_step_llama-3.1-8b_fp8_batch1_*, quantized_llama-3.1-8b_swiglu_one_block_*)."""


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension; strides {t.stride()}")


# ---- the Triton launchers
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """x, residual: [tokens, n]. Returns (rms_norm(residual + x), residual + x); without a
    residual, (rms_norm(x), x). quantize: the norm as QuantizedRows (fp8.quantize_rows' bits)."""
    _check_rows("x", x)
    tokens, n = x.shape
    out = torch.empty((tokens, n), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device) if quantize else out
    res_out = torch.empty_like(x) if residual is not None else x
    if tokens:
        res = residual if residual is not None else x
        _check_rows("residual", res)
        _add_rms_norm_kernel[(tokens,)](
            x, res, weight, out, res_out, scale, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), n,
            eps, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 2048 else 8, **pdl_options(x.device, tokens),
        )  # fmt: skip
    return (QuantizedRows(out, scale, x.dtype) if quantize else out), res_out


def norm_rope_qk(
    qk: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None, eps: float, store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qk: [tokens, q heads + k heads, head_dim], q's heads first (a strided view of qkv is fine);
    returns contiguous (q, k), each normalized by its weight (both or neither) then rotated. store: k and
    store.v go into the paged caches at their slots instead (store_kv's work, in this launch, scaled as
    KVStore says): (q, None)."""
    _check_rows("qk", qk)
    tokens, heads, head_dim = qk.shape
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"the fused rotary kernel takes a power-of-two head_dim; got {head_dim}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together (a q/k norm) or not at all")
    kv_heads = heads - num_q_heads
    q = torch.empty((tokens, num_q_heads, head_dim), dtype=qk.dtype, device=qk.device)
    if store is None:
        k = torch.empty((tokens, kv_heads, head_dim), dtype=qk.dtype, device=qk.device)
        # NOTE: STORE off: the caches' arguments are placeholders, never read
        k_out, caches, inverses, block_size = (k, k.stride(0), k.stride(1)), (qk,) * 4 + (0,) * 8, (1.0, 1.0), 1
    else:
        k, (v, kc, vc) = None, (store.v, store.k_cache, store.v_cache)
        _check_rows("v", v)
        if v.shape != (tokens, kv_heads, head_dim) or kc.shape[-2:] != (kv_heads, head_dim):
            raise ValueError(f"k and v of {tokens} tokens x {kv_heads} heads x {head_dim} go into the caches; got v "
                             f"{tuple(v.shape)}, a cache of {tuple(kc.shape)}")
        k_out = (q, 0, 0)  # NOTE: STORE on: k_out is a placeholder, never written
        caches = (v, kc, vc, store.slot_mapping, v.stride(0), v.stride(1), *kc.stride()[:3], *vc.stride()[:3])
        inverses, block_size = store.inverses(), kc.shape[1]
    if tokens:
        _norm_rope_kernel[(tokens, triton.cdiv(heads + (kv_heads if store else 0), NORM_ROPE_HEADS))](
            qk, cos, sin, q_weight if q_weight is not None else qk, k_weight if k_weight is not None else qk, q,
            k_out[0], qk.stride(0), qk.stride(1), q.stride(0), q.stride(1), k_out[1], k_out[2], cos.stride(0), eps,
            num_q_heads, heads, *caches, kv_heads, *inverses,
            HEAD_DIM=head_dim, HALF=head_dim // 2, BLOCK_H=NORM_ROPE_HEADS, HAS_NORM=q_weight is not None,
            STORE=store is not None, BLOCK_SIZE=block_size, num_warps=2, **pdl_options(qk.device, tokens),
        )  # fmt: skip
    return q, k


def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """gate_up [tokens, 2n] -> [tokens, n]; quantize: as QuantizedRows (fp8.quantize_rows' bits)."""
    _check_rows("gate_up", gate_up)
    tokens, two_n = gate_up.shape
    n = two_n // 2
    if quantize:
        q = torch.empty((tokens, n), dtype=FP8, device=gate_up.device)
        scale = torch.empty((tokens, 1), dtype=torch.float32, device=gate_up.device)
        if tokens:
            block = min(SWIGLU_ROW_BLOCK, triton.next_power_of_2(n))
            _silu_and_mul_quantized_kernel[(tokens,)](gate_up, q, scale, gate_up.stride(0), q.stride(0), n,
                                                      BLOCK=block, ONE_BLOCK=n <= block,
                                                      num_warps=16 if block >= 8192 else 8,
                                                      **pdl_options(q.device, tokens))
        return QuantizedRows(q, scale, gate_up.dtype)
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = 1024
        _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
            **pdl_options(out.device, tokens),
        )
    return out


