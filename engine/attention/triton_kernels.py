"""Triton kernels over the paged KV cache: store the step's K/V, and decode attention
(flash-decoding: split-K partials, then a reduce). Prefill/extend attention is in `triton_prefill`.

Knows the cache layout and the flat batch of `AttentionMetadata`, nothing of scheduling or of the
backend registry. The launchers take device tensors and host-side launch sizes only; none of them
reads a device value on the host (no synchronization).

Layouts (every last dimension contiguous):

| tensor | shape | dtype |
| --- | --- | --- |
| q, out | [num_tokens, num_heads, head_dim] | fp16 / bf16 / fp32 |
| k, v (new tokens) | [num_tokens, num_kv_heads, head_dim] | fp16 / bf16 / fp32 |
| k_cache, v_cache | [num_blocks, block_size, num_kv_heads, head_dim] | fp16 / bf16 / fp32 / fp8 (E4M3) |
| slot_mapping | [num_tokens], block_id * block_size + offset; < 0 skips the token | int64 |
| block_tables | [num_seqs, max_blocks] | int32 |
| seq_lens | [num_seqs], context length after the step | int32 |
| query_start_loc | [num_seqs + 1] | int32 |

Query heads of one KV head are processed together: row r of a tile is query head
kv_head * GROUP + r (decode) so K/V are read once per KV head, and the rows form the M of `tl.dot`,
padded to at least 16. Scores are kept in the log2 domain (scale * log2(e) folded in) and every
sum is float32. An FP8 cache (unit scale, engine/attention/base.py) is read as FP8 and converted to
the queries' dtype in registers (exact: E4M3 values are bfloat16 and float16 values); the store
kernel saturates at +-448 and rounds to nearest even, as `to_cache` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.base import DecodeRotation
from engine.pdl import after_previous, compiled, pdl_options
from engine.quant.fp8_kernels import round_e4m3

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs take exact fp32 products (the default would be tf32 on GPUs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_dtype(name: str, t: torch.Tensor, cache: bool = False) -> None:
    allowed = (torch.float16, torch.bfloat16, torch.float32) + ((torch.float8_e4m3fn,) if cache else ())
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; the Triton attention takes "
                         f"{', '.join(str(a).removeprefix('torch.') for a in allowed)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension; strides {t.stride()}")


# ---- store_kv
@triton.jit
def to_cache(x, cache_ptr):
    """x as the cache stores it (base.to_cache): FP8 saturated at +-448 and rounded to nearest even
    (round_e4m3, so the conversion is exact under Triton's interpreter too); other dtypes cast."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)).to(tl.float8e4nv)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    after_previous(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d
    tl.store(k_dst, to_cache(k, k_cache_ptr), mask=mask)
    tl.store(v_dst, to_cache(v, v_cache_ptr), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v[token]; one program a token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t, cache=name.endswith("cache"))
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        **pdl_options(k.device, num_tokens),
    )  # fmt: skip


# ---- decode: one query token per sequence
@triton.jit
def _split_keys(seq_len, window, num_splits, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(lo, keys per split) of a decode sequence: its keys are [lo, seq_len) (keys <= seq_len - 1 -
    window are masked), split evenly over num_splits programs in whole BLOCK_N tiles, so a short
    context in a launch sized for long ones still spreads over every split. The decode kernel and
    its reduce both split by this."""
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    tps = ((seq_len - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    return lo, tps


@triton.jit
def cache_blocks(bt_row, keys, key_ok, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """(block, offset) of each key of a sequence in the paged cache, through its block table row (the entries of
    the keys in key_ok read when MASKED, every entry otherwise): the block int64, the offset in it. NOTE: keys
    are never negative, so they are taken unsigned: a shift and a mask, where signed division and remainder
    round toward zero, and the block widened without its sign (on sm_90 the FP8 decode loop's instructions a
    128-key trip 653 against 837: bench/diag/sass_loop.py)."""
    index = keys.to(tl.uint32)
    if MASKED:
        block = tl.load(bt_row + index // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(bt_row + index // BLOCK_SIZE)
    return block.to(tl.uint32).to(tl.int64), index % BLOCK_SIZE


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, keys, key_ok, kv_head, d,
             stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, BLOCK_SIZE: tl.constexpr):
    """Addresses of a tile of keys [BLOCK_D, BLOCK_N] and of values [BLOCK_N, BLOCK_D] of one KV head,
    through the sequence's block table row (its entries read for the keys in key_ok)."""
    block, offset = cache_blocks(bt_row, keys, key_ok, BLOCK_SIZE, True)
    k_tile = k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko + kv_head * stride_kh + d[:, None]
    v_tile = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo + kv_head * stride_vh + d[None, :]
    return k_tile, v_tile


# NOTE: four E4M3 values (one 32-bit register) -> four float16 (two), two `cvt`s
_E4M3X4_TO_F16 = tl.constexpr("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n cvt.rn.f16x2.e4m3x2 $0, lo;\n"
                              " cvt.rn.f16x2.e4m3x2 $1, hi;}")


@triton.jit
def _values_as_f16(v):
    """An E4M3 tile of values as float16 (exact), converted where it was loaded. NOTE: not pure, so Triton
    cannot move it after the tile's trip through shared memory into the dot's operand layout: there an E4M3
    tile would be read a byte at a time (its keys run across rows, and ldmatrix transposes 16-bit values
    only), where float16 is read by transposing ldmatrix (bench/results/fp8_decode_attention_values_f16_*)."""
    return tl.inline_asm_elementwise(_E4M3X4_TO_F16, "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=False, pack=4)


@triton.jit
def _attend_tile(q, k, v, key_ok, m, l, acc, scale_log2, PRECISION: tl.constexpr, VALUES_ASM: tl.constexpr):
    """One tile of keys k [BLOCK_D, BLOCK_N] and values v [BLOCK_N, BLOCK_D] (key_ok: the keys that
    count, at least one) folded into the running max m, sum l and unnormalised output acc. VALUES_ASM
    (compiled, E4M3 values, float16 dots): the values converted by `_values_as_f16`."""
    s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where(key_ok[None, :], s, float("-inf"))
    # NOTE: every tile holds at least one key that counts, so m_new is finite in every row.
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    if VALUES_ASM:
        v = _values_as_f16(v)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def rotated(x, partner, c, s):
    """Rotary embedding as fused_kernels' rotary kernel rounds it: x * cos + rotate_half(x) * sin, each product
    rounded to x's dtype, then their sum; `partner` is x's other half at each column (rotate_half's values up to
    sign) and s carries that sign (-sin on the first half)."""
    dtype = x.dtype
    return ((x.to(tl.float32) * c).to(dtype).to(tl.float32) + (partner.to(tl.float32) * s).to(dtype).to(tl.float32)
            ).to(dtype)


@triton.jit
def _cos_sin(cos_row, sin_row, HEAD_DIM: tl.constexpr):
    """A token's cos row and its sin row signed as `rotated` takes them (-sin on the first half), float32, with
    rotate_half's column of each: (c, s, partner), [HEAD_DIM] each."""
    d = tl.arange(0, HEAD_DIM)
    c = tl.load(cos_row + d).to(tl.float32)
    s = tl.load(sin_row + d).to(tl.float32) * tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    return c, s, (d + HEAD_DIM // 2) % HEAD_DIM


@triton.jit
def _step_kv(k_row, v_row, c, s, partner, k_inverse, v_inverse, k_cache_ptr, v_cache_ptr,
             HEAD_DIM: tl.constexpr):
    """A step's key (its unrotated row at k_row, rotated by `_cos_sin`'s c, s, partner) and value (at v_row),
    [HEAD_DIM] each, as the caches hold them: times k_inverse and v_inverse, rounded to the activations' dtype,
    then `to_cache` (the rotary kernel's store). NOTE: bit for bit under the interpreter and, compiled, in
    float32; a compiled 16-bit key at head_dim 128 differed from the rotary kernel's in its last bit (H200,
    contraction), which any rounding of the projections may move as well."""
    d = tl.arange(0, HEAD_DIM)
    k = rotated(tl.load(k_row + d), tl.load(k_row + partner), c, s)
    v = tl.load(v_row + d)
    return (to_cache((k.to(tl.float32) * k_inverse).to(k.dtype), k_cache_ptr),
            to_cache((v.to(tl.float32) * v_inverse).to(v.dtype), v_cache_ptr))


# NOTE: integer arguments that change from step to step are not specialized: Triton compiles a
# variant for each of 1, a multiple of 16 and any other value, and a variant compiled at run time
# stalls its step by seconds (tests/gpu/test_compile_warmup_gpu.py).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, window, num_splits, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    cos_ptr, sin_ptr, k_new_ptr, v_new_ptr, slot_ptr, stride_c, stride_knt, stride_knh, stride_vnt, stride_vnh,
    q_scale, k_inverse, v_inverse,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, VALUES_ASM: tl.constexpr, ROTATE: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, num_kv_heads, num_splits). Program (seq, kv_head, split) attends the GROUP
    query heads of kv_head over the split-th of num_splits even parts (whole BLOCK_N tiles) of the
    sequence's keys (its context, clipped to the window). Sequences whose query count is
    not 1 are left to the prefill kernel. IS_SPLIT: write unnormalised partials (acc, max, sum) for
    `_decode_reduce_kernel`; else the one split covers the whole context and writes `out`.
    F16_DOTS (an FP8 cache, bfloat16 queries): the dots take float16 operands, the queries clamped to
    its range: E4M3 converts to float16 exactly in one instruction, where bfloat16 takes several.
    VALUES_ASM (compiled, an FP8 cache, 16-bit queries): values converted as `_attend_tile` says.
    Before its PDL wait a program reads the metadata (written before the step's layers ran) and, when
    its launch starts while the kernel before it ends (EARLY), its first tile of keys and values but
    the step's own: every key of a decode sequence but the newest was stored by a kernel of an earlier
    step, finished (engine/pdl.py), in the sequence's own blocks, which no sequence of the step writes;
    the newest, stored by the kernel before this one, is read after the wait. Launched in the stream's
    order, every tile is read in the loop (taking the first out of it slowed batch 8:
    bench/results/decode_first_tile_every_batch_ab_8b_2xh200).
    ROTATE (every sequence decoding; HEAD_DIM == BLOCK_D): q holds the step's queries unrotated; each program
    rotates its own (`rotated`, by the token's cos/sin rows, read before the wait as the metadata: written at the
    step's start) and scales them by q_scale. The program whose split holds the step's key makes that key
    (rotated) and the step's value as the cache holds them (`_step_kv`: the rotary kernel's store), stores both
    at the token's slot and waits at a block barrier; its loop then reads them back as the newest key. A row with
    no slot (below 0, a graph's padding) stores nothing and reads the key cached there, as after the rotary
    kernel. Every key but each row's newest must be in the cache before the launch: each row its own sequence
    (no two rows of one sequence, as a graph step's multi-row prompt has). The rotary kernel's launch saved."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    is_decode = tl.load(query_start_loc_ptr + seq + 1) - q_row == 1
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, tps = _split_keys(seq_len, window, num_splits, BLOCK_N, HAS_WINDOW)
    start = lo + split * tps
    end = tl.minimum(start + tps, seq_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if ROTATE:
        c, s, partner = _cos_sin(cos_ptr + q_row * stride_c, sin_ptr + q_row * stride_c, HEAD_DIM)
    if EARLY:
        keys = start + tl.arange(0, BLOCK_N)
        readable = tl.where(is_decode, end, start)  # none of a sequence left to the prefill kernel
        k_tile, v_tile = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, keys, keys < readable, kv_head, d,
                                  stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, BLOCK_SIZE)
        old = keys < tl.minimum(readable, seq_len - 1)
        k = tl.load(k_tile, mask=old[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_tile, mask=old[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    after_previous(PDL)
    if not is_decode:
        return
    if start >= end:
        return  # NOTE: the reduce reads only splits that hold keys, so nothing need be written

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q_rows = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if ROTATE:
        q = rotated(q, tl.load(q_rows + partner[None, :], mask=row_ok[:, None], other=0.0), c[None, :], s[None, :])
        q = (q.to(tl.float32) * q_scale).to(q_ptr.dtype.element_ty)
    if F16_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    if ROTATE:
        slot = tl.load(slot_ptr + q_row).to(tl.int64)
        if (start <= seq_len - 1) & (seq_len - 1 < end) & (slot >= 0):  # this split holds the step's key
            k_new, v_new = _step_kv(
                k_new_ptr + q_row * stride_knt + kv_head * stride_knh,
                v_new_ptr + q_row * stride_vnt + kv_head * stride_vnh, c, s, partner, k_inverse, v_inverse,
                k_cache_ptr, v_cache_ptr, HEAD_DIM,
            )
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_cache_ptr + block * stride_kb + offset * stride_ko + kv_head * stride_kh + d, k_new)
            tl.store(v_cache_ptr + block * stride_vb + offset * stride_vo + kv_head * stride_vh + d, v_new)
            tl.debug_barrier()  # NOTE: the program's stores visible to all its threads before the loop reads them
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = start
    if EARLY:
        new = keys == seq_len - 1  # in the first tile when the split ends within it; later tiles are read below
        k = tl.where(new[None, :], tl.load(k_tile, mask=new[None, :] & d_ok[:, None], other=0.0), k)
        v = tl.where(new[:, None], tl.load(v_tile, mask=new[:, None] & d_ok[None, :], other=0.0), v)
        m, l, acc = _attend_tile(q, k, v, keys < end, m, l, acc, scale_log2, PRECISION, VALUES_ASM)
        first = start + BLOCK_N
    for j in range(first, end, BLOCK_N):
        keys = j + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k_tile, v_tile = _kv_tile(k_cache_ptr, v_cache_ptr, bt_row, keys, key_ok, kv_head, d,
                                  stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, BLOCK_SIZE)
        k = tl.load(k_tile, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_tile, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        m, l, acc = _attend_tile(q, k, v, key_ok, m, l, acc, scale_log2, PRECISION, VALUES_ASM)

    if IS_SPLIT:
        idx = (seq * num_heads + heads) * num_splits + split  # [BLOCK_M] into [seqs, heads, splits]
        tl.store(part_m_ptr + idx, m, mask=row_ok)
        tl.store(part_l_ptr + idx, l, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        o = acc / l[:, None]
        tl.store(
            out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, query_start_loc_ptr,
    window, num_splits, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (num_seqs, num_heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the
    splits that held keys, M = max_s m_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)  # the metadata before the wait, as the decode kernel reads it
    is_decode = tl.load(query_start_loc_ptr + seq + 1) - q_row == 1
    seq_len = tl.load(seq_lens_ptr + seq)
    after_previous(PDL)
    if not is_decode:
        return
    lo, tps = _split_keys(seq_len, window, num_splits, BLOCK_N, HAS_WINDOW)
    last = (seq_len - lo + tps - 1) // tps  # splits [0, last) were written by the decode kernel
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < last) & (s < num_splits)
    idx = (seq * num_heads + head) * num_splits + s  # [BLOCK_S]
    m = tl.load(part_m_ptr + idx, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + idx, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # 0 for splits not written
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [BLOCK_D]
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


_WORKSPACE_ALIGN = 32  # elements (128 bytes) between the workspace's parts


def decode_workspace_numel(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> int:
    """float32 elements of the split-K partials: acc [seqs, heads, splits, head_dim], then max and
    sum [seqs, heads, splits], each part starting on a 128-byte boundary; 0 without splits."""
    if num_splits <= 1:
        return 0
    n = num_seqs * num_heads * num_splits
    return _align(n * head_dim) + 2 * _align(n)


def _align(numel: int) -> int:
    return -(-numel // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN


def _split_workspace(
    workspace: torch.Tensor, num_seqs: int, num_heads: int, num_splits: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (acc, max, sum) of the layout `decode_workspace_numel` counts."""
    n = num_seqs * num_heads * num_splits
    acc_end = _align(n * head_dim)
    part_acc = workspace[: n * head_dim].view(num_seqs, num_heads, num_splits, head_dim)
    part_m = workspace[acc_end : acc_end + n].view(num_seqs, num_heads, num_splits)
    part_l = workspace[acc_end + _align(n) : acc_end + _align(n) + n].view(num_seqs, num_heads, num_splits)
    return part_acc, part_m, part_l


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows of decode sequences are written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    scale: float,
    sliding_window: int | None,
    num_splits: int,
    tokens_per_split: int,
    max_splits: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    workspace: torch.Tensor | None = None,
    rotation: DecodeRotation | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Attention of every sequence with exactly one new token (others are skipped on the device).
    rotation (every sequence decoding, a power-of-two head_dim): q unrotated; the launch rotates it and stores
    rotation.k (rotated) and rotation.v at slot_mapping's slots itself (the kernel's ROTATE).

    The launch depends on the shapes of the metadata tensors and on (num_splits, tokens_per_split)
    only, not on their values: with those fixed per batch size, a CUDA graph can replay it.
    Each sequence's keys are split evenly over num_splits programs; tokens_per_split (a multiple of
    block_n, from `decode_split_plan`) is the longest split of the plan, checked, not needed by the
    kernels. max_splits bounds num_splits over every launch: the reduce kernel is compiled once for
    it, not once per split count. With num_splits > 1 the split-K partials need a float32 workspace of
    `decode_workspace_numel(...)` elements: `workspace` when given (a CUDA graph's static buffer),
    else allocated here.
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if tokens_per_split % block_n:
        raise ValueError(f"tokens_per_split={tokens_per_split} must be a multiple of block_n={block_n}")
    if not 1 <= num_splits <= max_splits:
        raise ValueError(f"num_splits={num_splits} must be in [1, max_splits={max_splits}]")
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    is_split = num_splits > 1
    if is_split:
        numel = decode_workspace_numel(num_seqs, num_heads, num_splits, head_dim)
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < numel or not workspace.is_contiguous():
            raise ValueError(
                f"the decode workspace needs {numel} contiguous float32 elements; got {workspace.numel()} "
                f"of {workspace.dtype}"
            )
        part_acc, part_m, part_l = _split_workspace(workspace, num_seqs, num_heads, num_splits, head_dim)
    else:
        part_acc = part_m = part_l = out  # not read
    window = sliding_window or 0
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    options = pdl_options(q.device, num_seqs)
    if rotation is not None:
        if block_d != head_dim or slot_mapping is None or q.shape[0] != num_seqs:
            raise ValueError(f"a rotating decode launch takes one query per sequence, a power-of-two head_dim and "
                             f"the slots; got {q.shape[0]} queries for {num_seqs} sequences, head_dim {head_dim}")
        cos, sin, k_new, v_new, q_scale, k_inverse, v_inverse = rotation
        rotating = (cos, sin, k_new, v_new, slot_mapping, cos.stride(0), k_new.stride(0), k_new.stride(1),
                    v_new.stride(0), v_new.stride(1), q_scale, k_inverse, v_inverse)
    else:  # NOTE: ROTATE off: placeholders, never read
        rotating = (q, q, q, q, seq_lens, 0, 0, 0, 0, 0, 1.0, 1.0, 1.0)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc,
        scale * LOG2E, window, num_splits, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), *rotating,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None, IS_SPLIT=is_split,
        PRECISION=dot_precision(q.dtype), F16_DOTS=fp8 and q.dtype == torch.bfloat16,
        VALUES_ASM=fp8 and q.dtype != torch.float32 and compiled(q.device), ROTATE=rotation is not None,
        EARLY=options["launch_pdl"], num_warps=num_warps, num_stages=num_stages, **options,
    )  # fmt: skip
    if is_split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_m, part_l, seq_lens, query_start_loc,
            window, num_splits, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=triton.next_power_of_2(max_splits),
            BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None, num_warps=4, **options,
        )  # fmt: skip
