"""Unit tests of kvtransfer.layout: the layout read off a cache tensor, its int encoding, the
mismatch message, and gather/scatter between scattered block ids and one contiguous buffer."""

from __future__ import annotations

import random

import pytest
import torch

from kvtransfer import KvLayout, LayoutMismatchError, gather_blocks, scatter_blocks

LAYOUT = KvLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")


def _kv(num_blocks: int, fill: str = "rand") -> torch.Tensor:
    shape = (3, 2, num_blocks, 4, 2, 8)  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    return (torch.randn(shape) if fill == "rand" else torch.zeros(shape)).to(torch.float16)


def test_from_kv_reads_every_field() -> None:
    assert KvLayout.from_kv(_kv(10)) == LAYOUT
    with pytest.raises(ValueError, match=r"\[layers, 2, num_blocks"):
        KvLayout.from_kv(torch.zeros(3, 3, 10, 4, 2, 8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_ints_round_trip(dtype: str) -> None:
    layout = KvLayout(num_layers=40, block_size=32, num_kv_heads=8, head_dim=128, dtype=dtype)
    ints = layout.to_ints()
    assert ints.dtype == torch.int64 and ints.shape == (KvLayout.NUM_INTS,)
    assert KvLayout.from_ints(ints) == layout
    assert KvLayout.from_ints(ints.tolist()) == layout


def test_from_ints_rejects_a_foreign_encoding() -> None:
    with pytest.raises(LayoutMismatchError, match="same pdserve version"):
        KvLayout.from_ints([1, 2, 3, 4, 5, 6])


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        KvLayout(num_layers=1, block_size=0, num_kv_heads=1, head_dim=8, dtype="float16")
    with pytest.raises(ValueError, match="'float7' is not supported; supported: float32"):
        KvLayout(num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype="float7")


def test_mismatch_names_every_differing_field_with_both_values() -> None:
    peer = KvLayout(num_layers=3, block_size=32, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    with pytest.raises(LayoutMismatchError) as info:
        LAYOUT.check_compatible(peer)
    message = str(info.value)
    assert "block_size: this worker has 4, the peer has 32" in message
    assert "dtype: this worker has float16, the peer has bfloat16" in message
    for same in ("num_layers", "num_kv_heads", "head_dim"):
        assert same not in message
    LAYOUT.check_compatible(KvLayout.from_kv(_kv(2)))  # equal layouts pass


def test_gather_scatter_round_trip_moves_exactly_the_named_blocks() -> None:
    rng = random.Random(0)
    src, dst = _kv(24), _kv(40, fill="zeros")
    src_ids = rng.sample(range(24), 7)  # non-contiguous, unordered
    dst_ids = rng.sample(range(40), 7)
    buf = gather_blocks(src, src_ids)
    assert buf.shape == (3, 2, 7, 4, 2, 8) and buf.is_contiguous()
    scatter_blocks(dst, torch.tensor(dst_ids), buf)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = sorted(set(range(40)) - set(dst_ids))
    assert not dst[:, :, untouched].any()


@pytest.mark.parametrize(
    "dtype, block_shape",
    [
        (torch.bfloat16, (4, 2, 8)),  # 128-byte blocks: moved as int64 words
        (torch.float32, (1, 1, 3)),  # 12 bytes: int32 words
        (torch.float16, (1, 1, 3)),  # 6 bytes: int16 words
        (torch.float16, (1, 1, 1)),  # 2 bytes: the values themselves
    ],
)
def test_gather_scatter_as_words_equal_moving_the_values(dtype: torch.dtype, block_shape: tuple[int, ...]) -> None:
    """Blocks move as the widest integer words their bytes divide into; the bytes are the values'."""
    torch.manual_seed(0)
    src = torch.randn(3, 2, 10, *block_shape).to(dtype)
    ids = [7, 2, 9, 0]
    buf = gather_blocks(src, ids)
    assert buf.dtype == dtype and buf.is_contiguous()
    assert torch.equal(buf, src.index_select(2, torch.tensor(ids)))
    dst = torch.zeros(3, 2, 12, *block_shape, dtype=dtype)
    scatter_blocks(dst, [11, 4, 5, 1], buf)
    want = torch.zeros_like(dst)
    want.index_copy_(2, torch.tensor([11, 4, 5, 1]), buf)
    assert torch.equal(dst, want)


def test_gather_and_scatter_check_ids_and_shapes() -> None:
    kv = _kv(8)
    with pytest.raises(ValueError, match=r"out of range for a cache of 8 blocks"):
        gather_blocks(kv, [1, 8])
    with pytest.raises(ValueError, match=r"expected \(3, 2, 2, 4, 2, 8\)"):
        scatter_blocks(kv, [0, 1], torch.zeros(3, 2, 3, 4, 2, 8, dtype=torch.float16))
