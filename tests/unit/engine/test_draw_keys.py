"""The sampler's draw keys (engine/draw_keys.py) on the CPU: a fused draw's one upload holds each seeded
row's `draw_seed` key, the step key plus the row's index for the others, and the inverse temperatures;
step keys follow the generator (reproducible from its seed, new at every draw)."""

from __future__ import annotations

import pytest
import torch

from engine.draw_keys import RaceRows, _splitmix64, as_int64, draw_seed, step_key

CPU = torch.device("cpu")


def test_as_int64_keeps_a_key_s_64_bits() -> None:
    for key in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert as_int64(key) % (1 << 64) == key
        assert -(1 << 63) <= as_int64(key) < 1 << 63


def test_step_keys_follow_the_generator() -> None:
    first = [step_key(torch.Generator().manual_seed(5), CPU) for _ in range(2)]
    assert first[0] == first[1]  # the same seed: the same key
    gen = torch.Generator().manual_seed(5)
    keys = [step_key(gen, CPU) for _ in range(50)]
    assert keys[0] == first[0]
    assert len(set(keys)) == 50  # each draw advances the generator


def _keys(rows: torch.Tensor, step: int) -> list[int]:
    """The keys `race` computes from RaceRows' rows at `step`: splitmix64(a ^ (b + step))."""
    a, b = rows[0::3].tolist(), rows[1::3].tolist()
    return [as_int64(_splitmix64((x % (1 << 64)) ^ ((y + step) % (1 << 64)))) for x, y in zip(a, b)]


def _inv_temps(rows: torch.Tensor) -> list[float]:
    return rows[2::3].clone().view(torch.float64).tolist()


def test_seeded_rows_key_as_draw_seed_and_a_steady_batch_uploads_once() -> None:
    race_rows = RaceRows(CPU)
    seeds = [5, 2**63 + 1]
    uploads = []
    for k in range(4):  # the rows' output positions move on by one a step, as in decoding
        rows, step = race_rows.next([(seeds[0], 0.5, 10 + k), (seeds[1], 2.0, k)], None)
        assert step == k
        assert _keys(rows, step) == [as_int64(draw_seed(seeds[0], 10 + k)), as_int64(draw_seed(seeds[1], k))]
        assert _inv_temps(rows) == [2.0, 0.5]
        uploads.append(rows)
    assert all(rows is uploads[0] for rows in uploads), "the same rows a step: no new upload"
    rows, step = race_rows.next([(seeds[0], 0.5, 14), (seeds[1], 2.0, 9)], None)  # a position off its stride
    assert rows is not uploads[0] and _keys(rows, step)[1] == as_int64(draw_seed(seeds[1], 9))
    again, _ = race_rows.next([(seeds[0], 0.7, 15), (seeds[1], 2.0, 10)], None)  # another temperature
    assert again is not rows and _inv_temps(again)[0] == 1 / 0.7


def test_unseeded_rows_draw_new_keys_every_step_reproducibly() -> None:
    def keys(seed: int) -> list[list[int]]:
        race_rows, gen = RaceRows(CPU), torch.Generator().manual_seed(seed)
        out = []
        for k in range(5):
            rows, step = race_rows.next([(None, 1.0, k), (None, 1.0, 40 + k), (7, 1.0, k)], gen)
            out.append(_keys(rows, step))
        return out

    first = keys(3)
    assert first == keys(3), "the generator's seed decides the unseeded keys"
    assert first != keys(4)
    unseeded = [key for step_keys in first for key in step_keys[:2]]
    assert len(set(unseeded)) == len(unseeded), "each row and step its own key"
    assert [step_keys[2] for step_keys in first] == [as_int64(draw_seed(7, k)) for k in range(5)]


def test_a_staged_batch_draws_from_the_generator_once() -> None:
    race_rows, gen = RaceRows(CPU), torch.Generator().manual_seed(8)
    race_rows.next([(None, 1.0, 0)], gen)
    state = gen.get_state()
    for k in range(1, 4):
        race_rows.next([(None, 1.0, k)], gen)
    assert torch.equal(gen.get_state(), state)
    race_rows.next([(None, 1.0, 4), (None, 1.0, 0)], gen)  # a new row: staged again, a new draw
    assert not torch.equal(gen.get_state(), state)


def test_steps_wrap_and_restage(monkeypatch: pytest.MonkeyPatch) -> None:
    """After step STEP_WRAP - 1 comes 0 again, and unchanged rows are staged anew there (new random a, so
    that no unseeded key repeats one of the steps before the wrap)."""
    from engine import draw_keys

    race_rows, gen = RaceRows(CPU), torch.Generator().manual_seed(2)
    first, _ = race_rows.next([(None, 1.0, 0)], gen)
    monkeypatch.setattr(race_rows, "_step", draw_keys.STEP_WRAP - 1)
    rows, step = race_rows.next([(None, 1.0, 1)], gen)
    assert step == draw_keys.STEP_WRAP - 1 and rows is first, "unchanged rows: not staged again"
    wrapped, step = race_rows.next([(None, 1.0, 2)], gen)
    assert step == 0 and wrapped is not first and wrapped[0] != first[0]
