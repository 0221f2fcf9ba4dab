"""The Triton attention backend against the torch reference, on the CPU through Triton's
interpreter: mixed batches (decode + extend over a cached prefix + fresh prompts) in one forward,
block boundaries, GQA ratios 1/2/3/4/8, one-token prompts, split-K decode, sliding window, random
non-contiguous block tables, and the cache written exactly at slot_mapping.

Every cache slot starts as NaN and only the cached prefixes get finite values, so a kernel that
writes a wrong slot, or reads a slot past a context's end, shows up as a mismatch or a NaN.
fp32 and fp16 only: bf16 is wrong under the CPU interpreter (checked on GPUs by
bench/attention_gpu.py). Shapes are tiny so the interpreter stays fast.

NOTE: TRITON_INTERPRET is read when a kernel is defined (`@triton.jit`, at the import of
engine.attention.triton_kernels; older Triton read it at `import triton`), so it is set here, before
both imports. Unless it was set before, it is removed again once the kernels exist and set only
around each test of this module (the interpreter reads it while running too), so that Triton code
imported later in the same session compiles as usual. If another module imported the kernels first
without it, they are compiled ones and this module skips.
"""

from __future__ import annotations

import os

_INTERPRET_WAS_SET = "TRITON_INTERPRET" in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from engine.attention import triton_kernels, triton_prefill  # noqa: E402
from engine.attention.base import AttentionMetadata, AttentionSpec, DecodeRotation  # noqa: E402
from engine.attention.base import available_backends, create_backend  # noqa: E402
from engine.attention.base import write_kv  # noqa: E402
from engine.attention.torch_ref import TorchAttention  # noqa: E402
from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig, decode_split_plan  # noqa: E402
from engine.models import fused_kernels  # noqa: E402  (its rotary kernel: the rotating decode launch's reference)
from engine.models.fused_ops import KVStore  # noqa: E402

if not _INTERPRET_WAS_SET:
    del os.environ["TRITON_INTERPRET"]  # back on around each test only (interpreted_triton)
if not all(isinstance(f, InterpretedFunction)
           for f in (triton_kernels._decode_kernel, triton_prefill._prefill_kernel, fused_kernels._norm_rope_kernel)):
    pytest.skip(
        "the Triton kernels were defined without TRITON_INTERPRET=1 (another module imported them first); "
        "run this module alone: TRITON_INTERPRET=1 pytest tests/unit/engine/attention/test_triton_interpret.py",
        allow_module_level=True,
    )



@pytest.fixture(autouse=True)
def interpreted_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter reads TRITON_INTERPRET while kernels run too, not only when they are defined."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# Small tiles: fewer interpreted operations. Decode contexts > 16 split into 16-key splits (the
# interpreter counts as 8 SMs; 64 programs a SM are never reached here, nor a crowded prefill launch's 8,192 rows).
SMALL = TritonAttentionConfig(
    decode_block_n=16, decode_fp8_block_n=16, prefill_block_m=16, prefill_block_n=16, prefill_fp8_block_m=16,
    prefill_fp8_block_n=16, prefill_crowded_block_m=32, prefill_crowded_block_n=16, prefill_fp8_crowded_block_m=32,
    prefill_fp8_crowded_block_n=16, prefill_crowded_rows_per_sm=1024, min_split_tokens=16, target_programs_per_sm=64,
)
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 3e-3, "rtol": 3e-3},
             torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@dataclass
class Batch:
    spec: AttentionSpec
    q: torch.Tensor  # [tokens, heads, dim]
    k: torch.Tensor  # [tokens, kv_heads, dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, dim], NaN but for the cached prefixes
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    seqs: list[tuple[int, int]],  # (num_new, seq_len) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
    kv_magnitude: float = 1.0,
) -> Batch:
    """A step's batch over a NaN-poisoned cache (of `cache_dtype`, default `dtype`) whose blocks are
    handed out in random order; K and V are standard normals times `kv_magnitude`, q divided by it."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, times: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * times).to(dtype)

    num_blocks = sum(-(-seq_len // block_size) for _, seq_len in seqs) + 3  # + spare blocks, never read
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype or dtype)
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables: list[list[int]] = []
    slots: list[int] = []
    starts = [0]
    for num_new, seq_len in seqs:
        assert 1 <= num_new <= seq_len
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        slot = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        prefix = seq_len - num_new
        write_kv(
            randn(prefix, num_kv_heads, head_dim, times=kv_magnitude),
            randn(prefix, num_kv_heads, head_dim, times=kv_magnitude), k_cache, v_cache,
            torch.tensor(slot[:prefix], dtype=torch.long),
        )  # fmt: skip
        tables.append(table)
        slots.extend(slot[prefix:])
        starts.append(starts[-1] + num_new)
    seq_lens = [seq_len for _, seq_len in seqs]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=tables,
        block_tables_tensor=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc_tensor=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(n for n, _ in seqs),
        max_seq_len=max(seq_lens),
    )
    num_tokens = starts[-1]
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window)
    return Batch(
        spec, randn(num_tokens, num_heads, head_dim, times=1 / kv_magnitude),
        randn(num_tokens, num_kv_heads, head_dim, times=kv_magnitude),
        randn(num_tokens, num_kv_heads, head_dim, times=kv_magnitude), k_cache, v_cache, meta,
    )  # fmt: skip


def check_against_reference(batch: Batch, config: TritonAttentionConfig = SMALL,
                            magnitude: float = 1.0) -> torch.Tensor:
    """Runs both backends on copies of the cache; outputs match (to the tolerance times the values'
    `magnitude`), caches are bit-identical (NaN where nothing was written). Returns the Triton output."""
    b = batch
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    want = TorchAttention(b.spec).forward(b.q, b.k, b.v, ref_k, ref_v, b.meta)
    got_k, got_v = b.k_cache.clone(), b.v_cache.clone()
    got = TritonAttention(b.spec, config).forward(b.q, b.k, b.v, got_k, got_v, b.meta)
    for got_cache, ref_cache in ((got_k, ref_k), (got_v, ref_v)):  # bit for bit (NaN where nothing was written)
        assert torch.equal(got_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "a NaN slot was read, or a row was never written"
    tolerance = TOLERANCE[b.q.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance["atol"] * magnitude, rtol=tolerance["rtol"])
    return got


# decode (one new token) | extend (cached prefix) | fresh prompt; block_size 4
MIXED = [(1, 1), (1, 16), (1, 17), (1, 31), (5, 21), (2, 9), (13, 13), (8, 8), (1, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_reference(dtype, group):
    check_against_reference(make_batch(MIXED, num_heads=2 * group, num_kv_heads=2, dtype=dtype, seed=group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_matches_reference(dtype):
    """An FP8 cache: stored saturated (K and V up to ~4 standard deviations of 150 pass 448) and rounded
    as the reference stores it, bit for bit; read as FP8 by decode and prefill alike."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, dtype=dtype, seed=11, cache_dtype=torch.float8_e4m3fn,
                       kv_magnitude=150.0)
    assert batch.k.float().abs().max() > 448
    check_against_reference(batch, magnitude=150.0)
    assert batch.k_cache.dtype == torch.float8_e4m3fn


def test_fp8_cache_decodes_bfloat16_queries_through_float16_dots():
    """Decode-only batches of bfloat16 queries over an FP8 cache (the served FP8 KV path: its dots in
    float16, its own tiles), one split and several, against the reference."""
    seqs = [(1, 70), (1, 45), (1, 3), (1, 17), (1, 1), (1, 32)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, seed=3,
                       cache_dtype=torch.float8_e4m3fn, kv_magnitude=150.0)
    assert decode_split_plan(len(seqs), 2, 70, 8, SMALL, fp8_cache=True)[0] > 1
    check_against_reference(batch, magnitude=150.0)
    one_split = dataclasses.replace(SMALL, target_programs_per_sm=1, decode_fp8_block_n=32)
    assert decode_split_plan(len(seqs), 2, 70, 8, one_split, fp8_cache=True)[0] == 1
    check_against_reference(batch, one_split, magnitude=150.0)


def record_launches(monkeypatch: pytest.MonkeyPatch, module: object = triton_kernels, name: str = "_decode_kernel",
                    **constexprs: object) -> list[dict[str, object]]:
    """Every launch's own options of the kernel `name` of `module` (the decode kernel by default), recorded as they
    come; `constexprs` replace the launch's (EARLY=True: compiled as for a launch that starts while the kernel
    before it ends, which the interpreter's, in the stream's order, never is)."""
    launches: list[dict[str, object]] = []
    kernel = getattr(module, name)

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **options):
                launches.append(dict(options))
                return kernel[grid](*args, **{**options, **constexprs})
            return launch

    monkeypatch.setattr(module, name, Recorded())
    return launches


def test_fp8_cache_prefills_bfloat16_queries_through_float16_dots(monkeypatch):
    """Mixed batches of bfloat16 queries over an FP8 cache (prefill, extend over a cached prefix, decode) against
    the reference: the prefill kernel launched with its dots in float16 (F16_DOTS), as the decode kernel."""
    launched = record_launches(monkeypatch, triton_prefill, "_prefill_kernel")
    batch = make_batch(MIXED, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, seed=7,
                       cache_dtype=torch.float8_e4m3fn, kv_magnitude=150.0)
    check_against_reference(batch, magnitude=150.0)
    assert launched and all(options["F16_DOTS"] for options in launched)


def test_prefill_launches_take_the_tiles_of_their_cache_dtype(monkeypatch):
    """The prefill kernel over an FP8 cache launches at the prefill_fp8_* tiles, over a 16-bit cache at the
    prefill_* ones (their best differ: README), each against the reference on a mixed batch."""
    launched = record_launches(monkeypatch, triton_prefill, "_prefill_kernel")
    config = dataclasses.replace(SMALL, prefill_block_m=16, prefill_block_n=16, prefill_num_warps=2,
                                 prefill_num_stages=2, prefill_fp8_block_m=32, prefill_fp8_block_n=32,
                                 prefill_fp8_num_warps=4, prefill_fp8_num_stages=3)
    for cache_dtype, tiles, magnitude in ((torch.float16, (16, 16, 2, 2), 1.0),
                                          (torch.float8_e4m3fn, (32, 32, 4, 3), 150.0)):
        batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, dtype=torch.float16, seed=31, cache_dtype=cache_dtype,
                           kv_magnitude=magnitude)
        check_against_reference(batch, config, magnitude=magnitude)
        last = launched[-1]
        assert (last["BLOCK_M"], last["BLOCK_N"], last["num_warps"], last["num_stages"]) == tiles
        assert config.prefill_tiles(cache_dtype == torch.float8_e4m3fn) == tiles
    with pytest.raises(ValueError, match="prefill_fp8_block_n=24"):
        TritonAttentionConfig(prefill_fp8_block_n=24)


def test_crowded_prefill_launches_take_the_crowded_tiles_of_their_cache_dtype(monkeypatch):
    """A prefill launch whose new query tokens reach crowded_prefill_tokens (at the interpreter's 8 SMs) takes the
    crowded tiles of its cache's dtype, one token fewer the others; a decoding sequence's token does not count; none
    does where the crowded tiles hold more than prefill_crowded_max_tile_tokens query tokens. Each launch against the
    reference."""
    launched = record_launches(monkeypatch, triton_prefill, "_prefill_kernel")
    config = dataclasses.replace(SMALL, prefill_crowded_rows_per_sm=24, prefill_crowded_num_warps=4,
                                 prefill_fp8_crowded_block_m=64, prefill_fp8_crowded_num_stages=3)
    backend = TritonAttention(AttentionSpec(4, 2, 16, 0.25), config)
    crowded = backend.crowded_prefill_tokens(torch.device("cpu"))
    assert crowded == config.crowded_prefill_tokens(4, 8) == 48  # 24 rows x 8 SMs / 4 heads
    bounded = dataclasses.replace(config, prefill_crowded_max_tile_tokens=8)  # 16 and 32 query tokens a tile: past it
    assert not any(bounded.takes_crowded_prefill(2, fp8) for fp8 in (False, True))
    assert TritonAttention(AttentionSpec(4, 2, 16, 0.25), bounded).crowded_prefill_tokens(torch.device("cpu")) is None
    for cache_dtype, magnitude in ((torch.float16, 1.0), (torch.float8_e4m3fn, 150.0)):
        fp8 = cache_dtype == torch.float8_e4m3fn
        for tokens, tiles in ((crowded, config.prefill_tiles(fp8, crowded=True)),
                              (crowded - 1, config.prefill_tiles(fp8))):
            seqs = [(1, 30), (tokens - 7, tokens + 2), (7, 7)]
            batch = make_batch(seqs, num_heads=4, num_kv_heads=2, dtype=torch.float16, seed=tokens,
                               cache_dtype=cache_dtype, kv_magnitude=magnitude)
            check_against_reference(batch, config, magnitude=magnitude)
            last = launched[-1]
            assert (last["BLOCK_M"], last["BLOCK_N"], last["num_warps"], last["num_stages"]) == tiles
    assert config.prefill_tiles(False, crowded=True) == (32, 16, 4, 3)
    assert config.prefill_tiles(True, crowded=True) == (64, 16, 4, 3)
    with pytest.raises(ValueError, match="prefill_crowded_block_m=48"):
        TritonAttentionConfig(prefill_crowded_block_m=48)
    with pytest.raises(ValueError, match="prefill_crowded_rows_per_sm=0"):
        TritonAttentionConfig(prefill_crowded_rows_per_sm=0)


def test_crowded_fp8_decode_launches_take_their_own_tiles(monkeypatch):
    """A decode launch over an FP8 cache of at least decode_fp8_crowded_programs_per_sm programs an SM (the CPU
    counts 8 SMs) takes the crowded tiles, one program fewer the others, counting the decoding sequences only
    (not a mixed batch's prompts); each against the reference. crowded_decode_seqs names the first crowded batch."""
    launches = record_launches(monkeypatch)
    config = dataclasses.replace(SMALL, target_programs_per_sm=1, decode_fp8_crowded_programs_per_sm=2,
                                 decode_fp8_crowded_num_warps=1, decode_fp8_crowded_num_stages=4)
    crowded, other = config.decode_tiles(True, 2.0), config.decode_tiles(True, 1.99)
    assert (crowded.num_warps, crowded.num_stages) == (1, 4) and crowded.block_n == other.block_n == 16
    assert (other.num_warps, other.num_stages) == (config.decode_fp8_num_warps, config.decode_fp8_num_stages) != (1, 4)
    assert config.decode_tiles(False, 64.0) == config.decode_tiles(False)  # a 16-bit cache: its tiles at any size
    cases = [([(1, 5 + i) for i in range(8)], crowded), ([(1, 5 + i) for i in range(7)], other),
             ([(1, 5 + i) for i in range(8)] + [(5, 21)], crowded), ([(1, 5 + i) for i in range(7)] + [(5, 21)], other)]
    for i, (seqs, tiles) in enumerate(cases):
        batch = make_batch(seqs, num_heads=4, num_kv_heads=2, dtype=torch.float16, seed=20 + i,
                           cache_dtype=torch.float8_e4m3fn, kv_magnitude=150.0)
        check_against_reference(batch, config, magnitude=150.0)
        assert (launches[-1]["num_warps"], launches[-1]["num_stages"]) == (tiles.num_warps, tiles.num_stages)
    assert TritonAttention(batch.spec, config).crowded_decode_seqs(torch.device("cpu")) == 8


def test_k_and_v_as_strided_views_of_a_fused_qkv_projection():
    """The model passes q, k, v as column slices of one [tokens, (heads + 2 kv_heads) * head_dim]
    projection; the kernels read them through their row strides, with no copy."""
    b = make_batch(MIXED, num_heads=4, num_kv_heads=2, dtype=torch.float32, seed=7)
    tokens = b.q.shape[0]
    qkv = torch.cat([b.q.flatten(1), b.k.flatten(1), b.v.flatten(1)], dim=1)
    nq, nk = b.q[0].numel(), b.k[0].numel()
    k = qkv[:, nq : nq + nk].view(tokens, *b.k.shape[1:])
    v = qkv[:, nq + nk :].view(tokens, *b.v.shape[1:])
    assert not k.is_contiguous() and not v.is_contiguous()
    check_against_reference(dataclasses.replace(b, k=k, v=v))


@pytest.mark.parametrize("block_size", [4, 16])
def test_block_boundaries(block_size):
    bs = block_size
    seqs = [(1, bs - 1), (1, bs), (1, bs + 1), (1, 2 * bs), (1, 2 * bs + 1),  # decode
            (bs, bs), (bs + 1, bs + 1), (bs - 1, bs - 1),  # fresh prompts
            (3, 2 * bs + 3), (bs, 2 * bs), (2, bs + 1), (bs + 1, 2 * bs - 1)]  # extend: prefix k*bs, +-1
    check_against_reference(make_batch(seqs, num_heads=4, num_kv_heads=2, block_size=bs, head_dim=32, seed=bs))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 1), (6, 2)])  # GQA 8; 3, not a power of two
def test_wide_and_odd_groups(num_heads, num_kv_heads):
    seqs = [(1, 23), (1, 2), (9, 30), (11, 11)]
    check_against_reference(make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=torch.float16))


def test_one_token_prompts():
    # A one-token prompt has num_new == 1: the decode kernel serves it; (2, 2) the prefill kernel.
    check_against_reference(make_batch([(1, 1), (1, 1), (2, 2), (1, 1)], num_heads=4, num_kv_heads=2))
    check_against_reference(make_batch([(1, 1)], num_heads=4, num_kv_heads=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_spans_several_splits(dtype):
    batch = make_batch([(1, 70), (1, 45), (1, 3), (1, 17)], num_heads=4, num_kv_heads=2, dtype=dtype)
    num_splits, tokens_per_split = decode_split_plan(4, 2, 70, 8, SMALL)
    assert num_splits == 5 and tokens_per_split == 16 and num_splits * tokens_per_split >= 70
    split = check_against_reference(batch)
    # The same with one split (no reduce kernel), through the launcher directly.
    b = batch
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    triton_kernels.store_kv(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    whole = torch.full_like(b.q, float("nan"))
    triton_kernels.decode_attention(
        b.q, k_cache, v_cache, whole, b.meta.block_tables_tensor, b.meta.seq_lens_tensor,
        b.meta.query_start_loc_tensor, scale=b.spec.scale, sliding_window=None, num_splits=1,
        tokens_per_split=80, max_splits=SMALL.max_splits, block_n=16,
    )  # fmt: skip
    torch.testing.assert_close(whole.float(), split.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize(("window", "dtype"), [(5, torch.float32), (16, torch.float32), (21, torch.float16)])
def test_sliding_window(window, dtype):
    seqs = [(1, 70), (1, 4), (1, 22), (6, 40), (30, 30), (3, 3), (17, 20)]
    check_against_reference(make_batch(seqs, num_heads=4, num_kv_heads=2, window=window, dtype=dtype, seed=window))


def test_larger_tiles_and_block_size_16():
    config = TritonAttentionConfig(decode_block_n=32, prefill_block_m=64, prefill_block_n=32, min_split_tokens=32)
    seqs = [(1, 66), (40, 66), (64, 64), (2, 33)]
    check_against_reference(make_batch(seqs, num_heads=4, num_kv_heads=1, head_dim=32, block_size=16), config)


def test_graph_max_context_fixes_the_decode_launch():
    batch = make_batch([(1, 30), (1, 9), (4, 12)], num_heads=4, num_kv_heads=2)
    check_against_reference(batch, TritonAttentionConfig(**{**SMALL.__dict__, "graph_max_context": 64}))
    b = batch
    with pytest.raises(ValueError, match="graph_max_context=16"):
        TritonAttention(b.spec, TritonAttentionConfig(graph_max_context=16)).forward(
            b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta
        )


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 2, 16)
    v_cache = torch.zeros(2, 4, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    triton_kernels.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 2]))
    assert torch.equal(k_cache.view(8, 2, 16)[5], k[0]) and torch.equal(v_cache.view(8, 2, 16)[2], v[2])
    assert k_cache.count_nonzero() == 2 * 2 * 16


def test_registered_for_cuda_only():
    assert "triton" in available_backends()
    spec = AttentionSpec(4, 2, 16, 0.25)
    with pytest.raises(ValueError, match="does not run on cpu"):
        create_backend("triton", spec, torch.device("cpu"))
    with pytest.raises(ValueError, match="power of two"):
        TritonAttentionConfig(prefill_block_n=24)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_early_decode_launch_matches_the_reference(monkeypatch, cache_dtype):
    """Compiled to read its first tile before the wait: mixed batches (the prefill kernel's sequences read
    nothing early), several splits and tiles a split, one split, block boundaries."""
    launches = record_launches(monkeypatch, EARLY=True)
    magnitude = 150.0 if cache_dtype == torch.float8_e4m3fn else 1.0
    check_against_reference(make_batch(MIXED, num_heads=4, num_kv_heads=2, seed=4, cache_dtype=cache_dtype,
                                       kv_magnitude=magnitude), magnitude=magnitude)
    batch = make_batch([(1, 70), (1, 16), (1, 17), (2, 9)], num_heads=4, num_kv_heads=2, seed=5,
                       cache_dtype=cache_dtype, kv_magnitude=magnitude)
    for programs_per_sm, plan in ((1, (1, 80)), (2, (2, 48))):  # one split of 5 tiles; two of 3
        config = dataclasses.replace(SMALL, min_split_tokens=32, target_programs_per_sm=programs_per_sm)
        assert decode_split_plan(4, 2, 70, 8, config, fp8_cache=cache_dtype == torch.float8_e4m3fn) == plan
        check_against_reference(batch, config, magnitude=magnitude)
    assert launches


@pytest.mark.parametrize("seq_len", [5, 16, 21])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_decode_reads_the_step_s_newest_key_only_after_its_wait(monkeypatch, seq_len, cache_dtype):
    """Under PDL the decode kernel reads its first tile of keys before it waits for the kernel before it, which
    stores the step's newest key. Here that key's slot holds NaN until the wait (a stand-in for `after_previous`
    stores it then), so a kernel that took it from before the wait would give NaN. One split of 16-key tiles:
    the newest key in the first tile (5, 16) or in the one after (21)."""
    b = make_batch([(1, seq_len)], num_heads=4, num_kv_heads=1, seed=seq_len, cache_dtype=cache_dtype)
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    triton_kernels.store_kv(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    block, offset = divmod(int(b.meta.slot_mapping[0]), k_cache.shape[1])
    stored_k, stored_v = k_cache[block, offset].clone(), v_cache[block, offset].clone()

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(b.q, float("nan"))
        triton_kernels.decode_attention(
            b.q, k, v, out, b.meta.block_tables_tensor, b.meta.seq_lens_tensor, b.meta.query_start_loc_tensor,
            scale=b.spec.scale, sliding_window=None, num_splits=1, tokens_per_split=32, max_splits=SMALL.max_splits,
            block_n=16,
        )  # fmt: skip
        return out

    want = TorchAttention(b.spec).forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta)
    assert not want.isnan().any()
    k_cache[block, offset] = v_cache[block, offset] = float("nan")
    waits: list[None] = []

    def after_previous(pdl: object) -> None:  # the kernel before has stored the newest key by now
        waits.append(None)
        k_cache[block, offset], v_cache[block, offset] = stored_k, stored_v

    monkeypatch.setattr(triton_kernels, "after_previous", after_previous)
    launches = record_launches(monkeypatch, EARLY=True)
    got = attend(k_cache, v_cache)
    assert [options["launch_pdl"] for options in launches] == [False]  # the interpreter's own is in stream order
    assert waits, "the decode kernel never waited"
    assert not got.isnan().any(), "the newest key was taken from before the wait"
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


# NOTE: float16, not bfloat16, beside an FP8 cache: the interpreter's bfloat16 dots give garbage (the kernels' own
# bfloat16 dots are checked on the GPU: tests/gpu/test_engine_gpu.py)
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float16, torch.float16),
                                                    (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_the_rotating_decode_launch_equals_the_rotary_kernel_then_decode(monkeypatch, dtype, cache_dtype, scaled,
                                                                        early):
    """forward_rotated on a decode-only batch (q and the new k unrotated, views of one qkv row): the decode launch
    rotates the queries, scales them, and stores the new keys (rotated) and values; its caches equal, bit for
    bit, and its output, to the activations' rounding, the rotary kernel storing (fused_kernels.norm_rope_qk with a
    KVStore) then forward on q times k_scale, as the model did; with a scaled cache or not, several splits and
    one, a row with no slot (a CUDA graph's padding: nothing stored, its cached key read), compiled as the early
    launch or not."""
    if early:
        record_launches(monkeypatch, EARLY=True)
    magnitude = 40.0 if cache_dtype == torch.float8_e4m3fn else 1.0
    b = make_batch([(1, 70), (1, 16), (1, 17), (1, 5)], num_heads=4, num_kv_heads=2, head_dim=16,
                   dtype=dtype, cache_dtype=cache_dtype, seed=9, kv_magnitude=magnitude)
    padding = int(b.meta.slot_mapping[3])
    write_kv(b.k[3:], b.v[3:], b.k_cache, b.v_cache, b.meta.slot_mapping[3:])  # the padding row's key exists
    meta = dataclasses.replace(b.meta, slot_mapping=torch.tensor(b.meta.slot_mapping.tolist()[:3] + [-1]))
    tokens, heads, dim = b.q.shape
    qkv = torch.cat([b.q.flatten(1), b.k.flatten(1), b.v.flatten(1)], dim=1)
    q, k, v = qkv[:, : heads * dim].view(b.q.shape), qkv[:, heads * dim : (heads + 2) * dim].view(b.k.shape), \
        qkv[:, (heads + 2) * dim :].view(b.v.shape)
    g = torch.Generator().manual_seed(3)
    cos, sin = ((torch.rand(tokens, dim, generator=g) * 2 - 1).to(dtype) for _ in range(2))
    # NOTE: k_scale a power of two: q times it is exact, where the interpreter's rounding of float32 to bfloat16
    # (not to nearest even) would tell the kernel's product from torch's; on a GPU both round to nearest even
    k_scale, v_scale = (2.0, 0.75) if scaled else (1.0, 1.0)
    for config in (SMALL, dataclasses.replace(SMALL, target_programs_per_sm=1)):  # 5 splits of the 70; one
        backend = TritonAttention(b.spec, config)
        want_k, want_v = b.k_cache.clone(), b.v_cache.clone()
        store = KVStore(v, want_k, want_v, meta.slot_mapping, k_scale, v_scale)
        q_rotated, _ = fused_kernels.norm_rope_qk(qkv[:, : (heads + 2) * dim].view(tokens, heads + 2, dim), heads,
                                                  cos, sin, None, None, 1e-6, store)
        want = backend.forward(q_rotated * k_scale if scaled else q_rotated, None, None, want_k, want_v, meta)
        got_k, got_v = b.k_cache.clone(), b.v_cache.clone()
        rotation = DecodeRotation(cos, sin, k, v, k_scale, *store.inverses())
        got = backend.forward_rotated(q, rotation, got_k, got_v, meta)
        assert not got.isnan().any()
        for got_cache, want_cache in ((got_k, want_k), (got_v, want_v)):  # NaN where nothing was written
            assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
        # a weighted mean of the values (standard normals times magnitude)
        assert 0.1 < got.abs().max() < 10 * magnitude
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance["atol"] * magnitude,
                                   rtol=tolerance["rtol"])
        assert not want_k.view(-1, dim)[padding].isnan().any()  # the padding row's key: cached, not stored again
    with pytest.raises(ValueError, match="decode-only"):
        backend.forward_rotated(q, rotation, got_k, got_v, dataclasses.replace(meta, max_query_len=2))
    with pytest.raises(ValueError, match="no two rows of one sequence"):
        backend.forward_rotated(q, rotation, got_k, got_v, dataclasses.replace(meta, rows_share_sequences=True))


def test_the_backend_rotates_small_decode_batches_of_a_row_a_sequence_only():
    """`rotates`: decode-only, no two rows of one sequence (a graph step's prompt rows), at most rotate_max_seqs
    sequences (where it paid), a power-of-two head_dim of 16 or more."""
    b = make_batch([(1, 9), (1, 5), (1, 3)], num_heads=4, num_kv_heads=2, head_dim=16)
    backend = TritonAttention(b.spec, dataclasses.replace(SMALL, rotate_max_seqs=3))
    assert backend.rotates(b.meta)
    assert not backend.rotates(dataclasses.replace(b.meta, rows_share_sequences=True))
    assert not TritonAttention(b.spec, dataclasses.replace(SMALL, rotate_max_seqs=2)).rotates(b.meta)
    assert not backend.rotates(make_batch([(2, 9), (1, 5)], num_heads=4, num_kv_heads=2, head_dim=16).meta)
    for dim in (8, 24):
        odd = make_batch([(1, 9)], num_heads=4, num_kv_heads=2, head_dim=dim)
        assert not TritonAttention(odd.spec, SMALL).rotates(odd.meta)
    with pytest.raises(ValueError, match="rotate_max_seqs=0"):
        dataclasses.replace(SMALL, rotate_max_seqs=0)
