"""The Triton kernels behind `int4.Int4Matmul` on CUDA, up to WORDS_MAX_ROWS rows (past it
`dequantize_words` and cuBLAS): 4-bit weights in `int4.to_words`' layout made
bfloat16 (or float16) in registers by their bits and multiplied on tensor cores, the weight the
product's first operand (its rows fill Hopper's wgmma M), x's rows the second; imported only by
CUDA models and interpreted tests.

A trip of the K loop is 128 columns: a tile's BLOCK_N x 16 int32 words, nibble i of word w column
16 i + w, so nibble i of every word is a tile of 16 columns against x's 16 contiguous ones; a group's
tiles side by side are one product (`_group_product`: the trip's eight at groups of 128 and more).
Two words (a thread's two adjacent columns) become eight registers of two numbers OFFSET + q by one
PTX block (two byte permutes, six shifts, eight AND-ORs: a nibble in the low mantissa bits of 128.0,
bfloat16, or 1024.0, float16, reads OFFSET + q exactly); OFFSET + z comes off each (exact, a packed
add for two), and a group's scale applies to its products' float32 tile. K is split over programs;
the last program of a tile sums the slices in order (split_k.store_split_k). The kernels it
replaced, on one H200 at Llama-3.1-8B's four projections (bench/results/int4_gemv_sweep_nvidia-h200
_r8_words_tiles.json): 70.7 against 91.1 us at one row, 72.0 against 140.1 at two, 76.7 / 83.1 /
152.6 against 280 / 281 / 519 at 8, 16 and 64 (bench/diag/int4_gemv_sweep.py says how it was found).
A dot a nibble tile before one a group: 84.1 against 66.0 us at one row, the engine's tiles
(int4_gemv_sweep_nvidia-h200_one_dot_{main,new}.json)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.pdl import PDL_PRODUCT_MAX_ROWS, after_previous, compiled, pdl_options
from engine.quant.split_k import store_split_k
from engine.sms import num_sms

MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
"""Per activation dtype, the bits and value (OFFSET) of 128.0 or 1024.0: a nibble q in their low
mantissa bits reads OFFSET + q."""


def word_asm(magic: int) -> str:
    """PTX: two words (columns 16 i + w and 16 i + w + 1 at nibble i) -> eight registers, nibble i's
    pair OFFSET + q (magic: MAGIC's bits)."""
    pair = hex(magic * 0x10001)
    lines = ["{", ".reg .b32 t<2>, u;", "prmt.b32 t0, $8, $9, 0x5410;", "prmt.b32 t1, $8, $9, 0x7632;"]
    for i in range(8):
        t, shift = f"t{i // 4}", 4 * (i % 4)
        if shift:
            lines.append(f"shr.b32 u, {t}, {shift};")
        lines.append(f"lop3.b32 ${i}, {'u' if shift else t}, 0x000F000F, {pair}, 0xEA;")
    return "\n".join(lines + ["}"])


@triton.jit
def _group_scales(s_ptr, tile, g, BLOCK_N: tl.constexpr, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """Group g's scales (float32) and OFFSET + zero points (DTYPE, exact) of a tile's rows: [BLOCK_N, 1] each. A
    row's pair is read as one 32-bit word (the scale its low half): an asynchronous copy takes 4 bytes or more, so
    the K loop's pipeline fetches the word a trip ahead, where two 16-bit loads were waited for in the trip."""
    pair = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + (tile + g) * BLOCK_N + tl.arange(0, BLOCK_N))
    s = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    zb = ((pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) + OFFSET).to(DTYPE)
    return s[:, None], zb[:, None]


@triton.jit
def _cat(a, b):
    """Tiles [R, C] side by side: [R, 2 C], a's columns first. NOTE: where a and b are a dot operand's registers
    (nibbles converted where their words were loaded) the result is too: Triton moves no data (sass_loop)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _side_by_side(n, i: tl.constexpr, COUNT: tl.constexpr):
    """Nibble tiles n[i] .. n[i + COUNT - 1] (COUNT of 1, 2, 4, 8) as one tile of their columns in order."""
    if COUNT == 1:
        tile = n[i]
    elif COUNT == 2:
        tile = _cat(n[i], n[i + 1])
    elif COUNT == 4:
        tile = _cat(_cat(n[i], n[i + 1]), _cat(n[i + 2], n[i + 3]))
    else:
        tile = _cat(_cat(_cat(n[i], n[i + 1]), _cat(n[i + 2], n[i + 3])),
                    _cat(_cat(n[i + 4], n[i + 5]), _cat(n[i + 6], n[i + 7])))
    return tile


@triton.jit
def _group_product(acc, nibbles, g, k, x_ptr, rm, m_ok, stride_x, s_ptr, tile, BLOCK_N: tl.constexpr,
                   OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """acc + one group's product: its nibbles [BLOCK_N, C] (OFFSET + q as int16 bits, the columns k .. k + C of
    group g, C <= GROUP) less their zero points, times x's C columns there, scaled by the group's scales. One dot,
    so its warpgroup MMAs issue back to back (a dot a 16-column nibble waited for each before the next)."""
    s, zb = _group_scales(s_ptr, tile, g, BLOCK_N, OFFSET, DTYPE)
    x = tl.load(x_ptr + rm[None, :] * stride_x + (k + tl.arange(0, nibbles.shape[1]))[:, None], mask=m_ok[None, :],
                other=0.0)  # [C, BLOCK_M]
    return acc + tl.dot(nibbles.to(DTYPE, bitcast=True) - zb, x) * s


# NOTE: M (the step's rows) is not specialized: one variant per BLOCK_M serves every batch size,
# none is compiled mid-serving (see engine/attention/triton_kernels.py's _decode_kernel).
@triton.jit(do_not_specialize=["M"])
def _words_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_x, stride_o,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, ASM: tl.constexpr, WORD_ASM: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:, n-block] (M <= BLOCK_M) over one k_per_split slice of K (a multiple of 128) per program along axis
    1; slices summed by split_k.store_split_k. ASM: the PTX conversion (CUDA); else
    Triton's operations compute the same (the interpreter runs no PTX)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    c = tl.arange(0, 16)
    n_ok, m_ok = rn < N, rm < M
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    groups = K // GROUP
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    tile = pid_n * groups  # the tile's first group's scales (to_words: [N / BLOCK_N, groups, BLOCK_N, 2])
    NIBBLES: tl.constexpr = min(GROUP, 128) // 16  # a group's nibbles in a trip
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    after_previous(PDL)
    for k0 in tl.range(k_begin, k_end, 128, num_stages=NUM_STAGES):
        words = tl.load(w_ptr + ((pid_n * (K // 128) + k0 // 128) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * 16
                        + c[None, :])  # [BLOCK_N, 16]
        if ASM:
            n = tl.inline_asm_elementwise(
                WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words], dtype=(tl.int16,) * 8, is_pure=True, pack=2)
        else:
            n = (((words & 0xF) | MAGIC).to(tl.int16), (((words >> 4) & 0xF) | MAGIC).to(tl.int16),
                 (((words >> 8) & 0xF) | MAGIC).to(tl.int16), (((words >> 12) & 0xF) | MAGIC).to(tl.int16),
                 (((words >> 16) & 0xF) | MAGIC).to(tl.int16), (((words >> 20) & 0xF) | MAGIC).to(tl.int16),
                 (((words >> 24) & 0xF) | MAGIC).to(tl.int16), (((words >> 28) & 0xF) | MAGIC).to(tl.int16))
        for i in tl.static_range(0, 8, NIBBLES):  # a group's nibbles at a time (the trip's 8 for groups of 128+)
            acc = _group_product(acc, _side_by_side(n, i, NIBBLES), (k0 + 16 * i) // GROUP, k0 + 16 * i, x_ptr, rm,
                                 m_ok, stride_x, s_ptr, tile, BLOCK_N, OFFSET, DTYPE)
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    # slice s of the sums at part_ptr + s * M * N
    store_split_k(acc, out_ptr + rm[:, None] * stride_o + rn[None, :], part_ptr + rm[:, None] * N + rn[None, :],
                  m_ok[:, None] & n_ok[None, :], pid_k, count_ptr + pid_n, M, N, bias_ptr, rn, n_ok, HAS_BIAS, SPLIT_K)


WORDS_MAX_ROWS = 64
"""The most rows `words_matmul` takes (one row tile); Int4Matmul multiplies more with cuBLAS after
`dequantize_words`. On an H200 at the 8B projections, summed (bench/results/int4_gemv_sweep_nvidia-h200_
r10_dequantize.json), the kernel against that: 186 against 319 us at 64 rows; at 128 rows in two 64-row
tiles 401 against 332 (K unsplit; split as at 64 rows, 314), at 256 rows 550-600 against 366, at 2,048
2,822 against 1,309 (each row tile converts the whole weight again)."""

WORDS_PROGRAMS = 512
"""Programs (tiles times K slices) of 64 weight rows `words_config` aims for up to 32 rows, half of it from 33 (K
split in powers of two until then, at most 16 slices of at least two trips); tiles of 128 rows aim for half as many
(the same rows times slices): on an H200 the split-K rule picked the sweep's best tile at every 8B projection up to
16 rows, and at 64 rows split 4 gained 1.4x on o and down over split 8
(bench/results/int4_gemv_sweep_nvidia-h200_r8_words_tiles.json); at 128 rows a tile, split 8 beat 16 on o and down
(6.5 against 8.9 us, 13.6 against 16.0 at one row: int4_gemv_sweep_scale_pair_word_nvidia-h200.json)."""

MAX_TILES = 1 << 14
"""Output tiles of one `words_matmul` split over K its count buffer (`split_k_counts`) serves."""


def words_config(m: int, n: int, k: int, block_n: int, num_sms: int | None) -> tuple[int, int]:
    """(block_m, split_k) for x [m, k] (m <= WORDS_MAX_ROWS) against a weight of n rows in tiles of
    block_n (16 to 128 weight rows); block_m: 16, 32 or 64 of x's rows a tile. num_sms: the device's SMs
    (None on the CPU: then the split aims at WORDS_PROGRAMS only)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles, trips = triton.cdiv(n, block_n), k // 128
    target = (WORDS_PROGRAMS if block_m <= 32 else WORDS_PROGRAMS // 2) * 64 // max(block_n, 64)
    split = 1
    while tiles * split < target and split < 16 and trips // (2 * split) >= 2:
        split *= 2
    # NOTE: up to WORDS_TAIL_MAX_ROWS rows a program is light and many stay resident: split further while the
    # programs' last round over the SMs leaves WORDS_IDLE_TAIL more of them idle than the split after it would
    while (m <= WORDS_TAIL_MAX_ROWS and num_sms and split < 16 and trips // (2 * split) >= 2
           and _idle_tail(tiles * split, num_sms) > _idle_tail(tiles * 2 * split, num_sms) + WORDS_IDLE_TAIL):
        split *= 2
    return block_m, split


WORDS_TAIL_MAX_ROWS = 8
"""The most rows at which `words_config` splits K further for the SMs' last round of programs (WORDS_IDLE_TAIL)."""

WORDS_IDLE_TAIL = 0.1
"""How much less idle the SMs' last round of programs must be for `words_config` to split K once more, up to
WORDS_TAIL_MAX_ROWS rows. On an H200 (132 SMs) at 128-row tiles and one row, in three sweeps (bench/results/
int4_gemv_sweep_128_row_tiles_{new,old}, int4_gemv_sweep_scale_pair_word): gate_up's 224 tiles split 4 (896
programs, 6.8 an SM: 3% idle) 23.3-23.4 us against split 2 (448, 3.4 an SM: 18% idle) 24.4-24.7; o, down (32 tiles)
and qkv (48) keep their split 8 (256 and 384 programs, 3% idle). W4A16 8B decode steps, new / old / new in one call
(quantized_llama-3.1-8b_w4a16_idle_tail_split_*): batch 1 2.318 / 2.341 / 2.287 ms, 8 2.945 / 2.987 / 2.933; at
16 (gate_up's split 4 flat in the sweeps there) 3.464 / 3.418 / 3.444, hence the 8 rows."""


def _idle_tail(programs: int, num_sms: int) -> float:
    """The SMs' idle share over whole rounds of `programs` spread over `num_sms` (0: the last round full)."""
    rounds = programs / num_sms
    return math.ceil(rounds) / rounds - 1.0


def words_num_warps(block_m: int, block_n: int) -> int:
    """Warps of a words_matmul program: 4, 8 for tiles of more than 16 x 64 rows and columns, which 4 warps hold
    only by spilling (sm_90, 128 weight rows a tile: 255 registers and a 8-byte stack at 32 rows, 128 bytes at 64;
    8 warps at 64: 170 registers, no stack, tests/unit/engine/test_kernels_compile.py)."""
    return 8 if block_m > 16 and block_n > 64 else 4


def split_k_counts(device: torch.device) -> torch.Tensor:
    """A zeroed count per output tile for `words_matmul`'s slices; each launch leaves it zeroed."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def words_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 block_n: int, counts: torch.Tensor, config: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] (float16 or bfloat16) @ W.T (+ bias) for W in int4.to_words' layout of block_n rows a
    tile (weight as its bytes [N, K / 2], weight_scale [N, groups, 2]); counts: split_k_counts'.
    config: (block_m, split_k), words_config's by default."""
    m, k = x.shape
    if m > WORDS_MAX_ROWS:
        raise ValueError(f"words_matmul takes at most WORDS_MAX_ROWS={WORDS_MAX_ROWS} rows, got {m}: "
                         "multiply more after dequantize_words")
    n, groups = weight_scale.shape[0], weight_scale.shape[1]
    group = k // groups
    magic, offset = MAGIC[x.dtype]
    block_m, split_k = config or words_config(m, n, k, block_n, num_sms(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(k // 128, split_k) * 128
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    grid = (n // block_n, split_k)
    if split_k > 1 and grid[0] > MAX_TILES:
        raise ValueError(f"words_matmul of {n} output rows split over K takes {grid[0]} counts; at most {MAX_TILES}")
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    _words_kernel[grid](
        x, weight.view(torch.int32), weight_scale, bias if bias is not None else x, out, part, counts, m, n, k,
        k_per_split, x.stride(0), out.stride(0), GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT_K=split_k, ASM=compiled(x.device), WORD_ASM=word_asm(magic), MAGIC=magic, OFFSET=offset,
        NUM_STAGES=3, num_warps=words_num_warps(block_m, block_n),
        **pdl_options(x.device, m, max_rows=PDL_PRODUCT_MAX_ROWS))
    return out


@triton.jit
def _dequantize_words_kernel(w_ptr, s_ptr, out_ptr, K, stride_o, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                             PDL: tl.constexpr):
    """One tile's trip (BLOCK_N rows x 128 columns) of to_words' layout -> (q - z) * s in out's dtype,
    rounded once from float32 (as int4.dequantize)."""
    pid_n, trip = tl.program_id(0), tl.program_id(1)
    c = tl.arange(0, 16)
    r = tl.arange(0, BLOCK_N)
    groups = K // GROUP
    after_previous(PDL)
    words = tl.load(w_ptr + ((pid_n * (K // 128) + trip) * BLOCK_N + r)[:, None] * 16 + c[None, :])
    out = out_ptr + (pid_n * BLOCK_N + r)[:, None] * stride_o + trip * 128 + c[None, :]
    for i in tl.static_range(8):
        g = (trip * 128 + 16 * i) // GROUP
        scale = s_ptr + ((pid_n * groups + g) * BLOCK_N + r) * 2
        s = tl.load(scale).to(tl.float32)[:, None]
        z = tl.load(scale + 1).to(tl.float32)[:, None]
        q = ((words >> (4 * i)) & 0xF).to(tl.float32)
        tl.store(out + 16 * i, ((q - z) * s).to(out_ptr.dtype.element_ty))


def dequantize_words(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                     block_n: int) -> torch.Tensor:
    """int4.dequantize for a weight in to_words' layout of block_n rows a tile -> [N, K] in `dtype`."""
    n, half = weight.shape
    k = 2 * half
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantize_words_kernel[(n // block_n, k // 128)](
        weight.view(torch.int32), weight_scale, out, k, out.stride(0), GROUP=k // weight_scale.shape[1],
        BLOCK_N=block_n, num_warps=4, **pdl_options(weight.device, n, max_rows=0))
    return out
