"""Triton prefill/extend attention over the paged KV cache: the n > 1 new queries of each sequence
(positions [seq_len - n, seq_len)) over its whole context (cached prefix + the new tokens, already
stored), causal, optional sliding window. Layouts as in `triton_kernels`.

Flash-attention style: a program owns BLOCK_Q query tokens x the GROUP query heads of one KV head
(BLOCK_M = BLOCK_Q * GROUP rows of one `tl.dot`), walks the keys in tiles of BLOCK_N read through
the block table and keeps an online softmax; no [T, T] matrix exists anywhere. Knows nothing of
decode (sequences with one query are skipped on the device) or of the backend around it.

Tiles are numbered without any host knowledge of per-sequence lengths: sequence i owns tile
numbers [query_start_loc[i] // BLOCK_Q + i, query_start_loc[i + 1] // BLOCK_Q + i + 1), so
num_tokens // BLOCK_Q + num_seqs programs along axis 0 cover every sequence; a program finds its
sequence by binary search over query_start_loc and leaves if its tile is past the sequence's end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import LOG2E, cache_blocks, dot_precision


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i with query_start_loc[i] // BLOCK_Q + i <= tile."""
    # NOTE: annotated so both are tensors even when num_seqs == 1 arrives as a constexpr.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    acc, l, m, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, j, key_end, kv_head, window, scale_log2,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys [j, j + BLOCK_N) into the running (acc, l, m). MASKED: apply the
    causal/window mask and read no key at or past key_end; else every key is visible to every row.
    The dots take q's dtype (float16 over an FP8 cache of bfloat16 queries: `_prefill_kernel`'s F16_DOTS)."""
    keys = j + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    key_ok = keys < key_end
    block, offset = cache_blocks(bt_row, keys, key_ok, BLOCK_SIZE, MASKED)
    if not MASKED:
        key_ok = keys >= 0  # all true; lets the loads below drop the key mask
    k = tl.load(
        k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko + kv_head * stride_kh + d[:, None],
        mask=key_ok[None, :] & d_ok[:, None], other=0.0,
    )  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # NOTE: a row may have seen no visible key yet (window, padding rows): keep exp2 finite.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo + kv_head * stride_vh + d[None, :],
        mask=key_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, l, m_new


# NOTE: num_seqs and the block table's width change from step to step: not specialized, so one
# variant serves every step (see _decode_kernel).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
):  # fmt: skip
    """Grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads); see the module docstring. F16_DOTS (an FP8 cache,
    bfloat16 queries), as the decode kernel's: the dots take float16 operands, the queries clamped to its range;
    E4M3 tiles convert to float16 in one instruction a pair, to bfloat16 through a conversion each (on sm_90 the
    loop's instructions a 64-key trip at 8 warps 401 against 506: tests/unit/engine/test_kernels_compile.py)."""
    # NOTE: last tiles first: a sequence's later tiles see more keys; starting them first shortens the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if num_new < 2:
        return  # decode sequences belong to the decode kernel
    tok0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, within the sequence
    if tok0 >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - num_new + tok0  # context position of the tile's first query

    # Row r: query token tok0 + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (tok < num_new)
    q_pos = first_pos + rows // GROUP  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_rows, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if F16_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    key_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # one past the tile's last query position
    # Keys [lo, full_end) are visible to every row: no mask. Keys [full_end, key_end) are masked.
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    else:
        lo = seq_len * 0
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for j in range(lo, full_end, BLOCK_N):
        acc, l, m = _attend_tile(
            acc, l, m, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, j, key_end, kv_head, window, scale_log2,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            BLOCK_D, HEAD_DIM, BLOCK_N, BLOCK_SIZE, False, HAS_WINDOW, PRECISION,
        )  # fmt: skip
    for j in range(full_end, key_end, BLOCK_N):
        acc, l, m = _attend_tile(
            acc, l, m, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, j, key_end, kv_head, window, scale_log2,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
            BLOCK_D, HEAD_DIM, BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW, PRECISION,
        )  # fmt: skip
    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    out = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows of sequences with n > 1 are written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    scale: float,
    sliding_window: int | None,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> None:
    """Attention of every sequence with more than one new token (others are skipped on the device).

    block_m rows = block_m // group query tokens x group heads; raised to the group's next power
    of two if smaller.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_seqs == 0 or num_tokens == 0:
        return
    group = num_heads // num_kv_heads
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        num_seqs, scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(q.dtype), F16_DOTS=k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
