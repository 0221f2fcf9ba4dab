"""Q4_K blocks from float weights, which the `gguf` package reads but cannot write: the lab's way to a Q4_K
GGUF of a checkpoint trained here (bench/gguf_write.py), to measure what the format costs in perplexity.

The layout is the one `gguf.quants.Q4_K.dequantize_blocks` reads (llama.cpp's block_q4_K): per 256 values, a
float16 d and dmin, 12 bytes packing eight 6-bit scales and eight 6-bit mins, and 128 bytes of 4-bit values;
value = d * scale_j * q - dmin * min_j for sub-block j of 32. Each sub-block's (scale, min) is searched as
llama.cpp's make_qkx2_quants searches it (weights |x| + rms(x), 21 candidate inverse scales around 15 / range,
each refit by weighted least squares, the min kept at or below 0), then both sets are rounded to 6 bits under
the super-block's d and dmin and the 4-bit values recomputed under the rounded ones.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = 144  # 2 (d) + 2 (dmin) + 12 (scales, mins) + 128 (values)


def _sub_block_fits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, 32] -> the (scale >= 0, min >= 0) per row minimising sum w (scale q - min - x)^2, q in 0..15."""
    w = np.abs(x) + np.sqrt((x * x).mean(axis=1, keepdims=True))
    lo = np.minimum(x.min(axis=1, keepdims=True), 0.0)
    hi = x.max(axis=1, keepdims=True)
    span = np.where(hi > lo, hi - lo, 1.0)
    best_scale = (hi - lo) / 15.0
    best_min = -lo
    q = np.clip(np.rint((x - lo) / np.where(best_scale > 0, best_scale, 1.0)), 0, 15)
    best_err = (w * (best_scale * q - best_min - x) ** 2).sum(axis=1, keepdims=True)
    sw, swx = w.sum(axis=1, keepdims=True), (w * x).sum(axis=1, keepdims=True)
    for step in range(21):
        iscale = (-1.0 + 0.1 * step + 15.0) / span
        q = np.clip(np.rint(iscale * (x - lo)), 0, 15)
        swl, swl2 = (w * q).sum(1, keepdims=True), (w * q * q).sum(1, keepdims=True)
        swlx = (w * q * x).sum(1, keepdims=True)
        det = sw * swl2 - swl * swl
        ok = det > 0
        scale = np.where(ok, (sw * swlx - swx * swl) / np.where(ok, det, 1.0), 0.0)
        offset = np.where(ok, (swl2 * swx - swl * swlx) / np.where(ok, det, 1.0), 0.0)  # the fit's y = scale q + offset
        positive = offset > 0  # a min above 0 is not stored: refit the scale alone with offset 0
        scale = np.where(positive, swlx / np.where(swl2 > 0, swl2, 1.0), scale)
        offset = np.where(positive, 0.0, offset)
        err = (w * (scale * q + offset - x) ** 2).sum(axis=1, keepdims=True)
        better = ok & (err < best_err) & (scale >= 0)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, -offset, best_min)
    return best_scale[:, 0], best_min[:, 0]


def _six_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """values [n, 8] >= 0 -> (the super-block's float16 step [n], 6-bit levels [n, 8]) with level * step ~ value."""
    top = values.max(axis=1)
    step = (top / 63.0).astype(np.float16)
    levels = np.clip(np.rint(values / np.where(step > 0, step.astype(np.float32), 1.0)[:, None]), 0, 63)
    return step, levels.astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x [rows, cols] (cols a multiple of 256) -> uint8 [rows, cols / 256 * 144], Q4_K blocks row by row."""
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values; got {cols}")
    sub = x.astype(np.float32).reshape(-1, 32)
    scale, minimum = _sub_block_fits(sub)
    n = sub.shape[0] // 8
    d, ls = _six_bits(scale.reshape(n, 8))
    dmin, lm = _six_bits(minimum.reshape(n, 8))
    step = (d.astype(np.float32)[:, None] * ls).reshape(-1, 1)
    offset = (dmin.astype(np.float32)[:, None] * lm).reshape(-1, 1)
    q = np.clip(np.rint((sub + offset) / np.where(step > 0, step, 1.0)), 0, 15).astype(np.uint8)
    q = np.where(step > 0, q, 0).reshape(n, 4, 2, 32)
    packed_q = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    packed_scales = np.concatenate([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
    ], axis=1).astype(np.uint8)
    blocks = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), packed_scales,
                             packed_q], axis=1)
    return blocks.reshape(rows, cols // QK_K * BLOCK_BYTES)
