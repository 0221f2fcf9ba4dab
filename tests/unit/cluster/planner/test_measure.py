"""A profile measured on the engine at hand (the default model on the CPU): its grids as asked,
positive times, and the engine left with nothing running and no block held."""

from __future__ import annotations

import random

import pytest

from cluster.planner.measure import measure


def test_measure_fills_the_grids_and_leaves_the_engine_idle(make_llm):
    engine = make_llm(num_blocks=256, block_size=8).engine
    lines: list[str] = []
    profile = measure(engine, (16, 64), (1, 4), (16, 48), repeats=2, report=lines.append)
    assert profile.prefill_tokens == (16, 64) and len(profile.prefill_ms) == 2
    # a line per figure as it is measured (a profile that stops shows where)
    expected = ["prefill of 16 tokens", "prefill of 64 tokens", *(f"decode of {b} x {c} tokens" for b in (1, 4)
                                                                  for c in (16, 48))]
    measured = [line for line in lines if "taken as" not in line]  # NOTE: CPU times may dip: the grid is raised
    assert [line.split(":")[0] for line in measured] == expected
    assert len(profile.decode_ms) == 2 and all(len(row) == 2 for row in profile.decode_ms)
    assert all(t > 0 for t in profile.prefill_ms) and all(t > 0 for row in profile.decode_ms for t in row)
    assert profile.max_num_batched_tokens == engine.config.scheduler.max_num_batched_tokens
    assert not engine.has_unfinished()


def test_a_grid_the_cache_cannot_hold_is_refused(make_llm):
    engine = make_llm(num_blocks=16, block_size=8).engine
    with pytest.raises(ValueError, match="KV tokens"):
        measure(engine, (16,), (8,), (64,), repeats=1)


def test_an_engine_that_steps_asynchronously_is_refused(make_llm):
    # its step() returns once the next step is queued: the time would be the launch's, not the step's
    engine = make_llm(num_blocks=256, block_size=8, async_scheduling=True).engine
    with pytest.raises(ValueError, match="async_scheduling=False"):
        measure(engine, (16,), (1,), (16,), repeats=1)
    assert not engine.has_unfinished()


def test_a_decode_figure_times_the_whole_batch_and_computes_no_prompt(make_llm, monkeypatch):
    # 4 sequences of 128 tokens with 32-token steps: their prompts computed would take 16+ steps; taken as
    # already in their blocks (as a decode worker takes a pushed prompt), the batch decodes at once
    import cluster.planner.measure as measuring

    engine = make_llm(num_blocks=256, block_size=8, max_num_batched_tokens=32).engine
    timed_batches, prompt_tokens = [], []
    timed_step = measuring._timed_step
    schedule = engine.scheduler.schedule

    def counting(e):
        timed_batches.append(len(e.scheduler.running))
        return timed_step(e)

    def scheduled(*args, **kwargs):
        out = schedule(*args, **kwargs)
        prompt_tokens.append(out.num_prompt_tokens)
        return out

    monkeypatch.setattr(measuring, "_timed_step", counting)
    profile = measuring.measure(engine, (16, 32), (1, 4), (128,), repeats=2)
    assert timed_batches[-2:] == [4, 4] and timed_batches[-4:-2] == [1, 1]
    engine.scheduler.schedule = scheduled
    measuring.decode_ms(engine, 4, 128, 2, random.Random(0))
    assert sum(prompt_tokens) == 0 and len(prompt_tokens) >= 3  # warm-up and timed steps, no prompt
    assert len(profile.decode_ms) == 2 and not engine.has_unfinished()


def test_a_decode_figure_times_asynchronous_steps_and_leaves_the_engine_synchronous(make_llm, monkeypatch):
    # a served engine steps asynchronously (the host's work beside the device's): the figure times such steps,
    # then every request runs to its last token, so the next figure starts with no step in flight
    import cluster.planner.measure as measuring

    engine = make_llm(num_blocks=256, block_size=8).engine
    modes = []
    timed_step = measuring._timed_step

    def recording(e):
        modes.append(e.async_scheduling)
        return timed_step(e)

    monkeypatch.setattr(measuring, "_timed_step", recording)
    assert measuring.decode_ms(engine, 2, 16, 3, random.Random(0)) > 0
    assert modes == [True, True, True]
    assert engine.async_scheduling is False and not engine.has_unfinished() and engine._inflight is None
    assert engine.pool.num_held_blocks == 0
    modes.clear()
    measuring.prefill_ms(engine, 16, 2, random.Random(0))
    assert modes == [False, False, False]  # a prefill figure's step runs alone, synchronously


def test_the_decode_grid_is_made_monotone_and_the_raised_points_reported():
    from cluster.planner.measure import monotone

    # as the 8B profile on 2x H200 read (three steps a figure): 32 x 4096 under 8 x 4096 and 32 x 1024
    grid = [[4.90, 4.86, 5.15], [5.26, 5.41, 6.66], [6.01, 6.90, 5.99]]
    lines: list[str] = []
    out = monotone(grid, (1, 8, 32), (256, 1024, 4096), lines.append)
    assert out == [[4.90, 4.90, 5.15], [5.26, 5.41, 6.66], [6.01, 6.90, 6.90]]
    assert lines == ["decode of 1 x 1024 tokens: 4.86 ms measured, under a smaller point's 4.90: taken as 4.90",
                     "decode of 32 x 4096 tokens: 5.99 ms measured, under a smaller point's 6.90: taken as 6.90"]
    assert grid[2][2] == 5.99  # the measured grid is left as it was
    assert monotone([[1.0, 2.0], [3.0, 4.0]], (1, 2), (1, 2)) == [[1.0, 2.0], [3.0, 4.0]]


def test_decode_figures_take_their_own_repeats(make_llm, monkeypatch):
    import cluster.planner.measure as measuring

    engine = make_llm(num_blocks=256, block_size=8).engine
    timed: list[int] = []
    timed_step = measuring._timed_step
    monkeypatch.setattr(measuring, "_timed_step", lambda e: timed.append(len(e.scheduler.running)) or timed_step(e))
    measuring.measure(engine, (16,), (2,), (16,), repeats=1, decode_repeats=5)
    assert timed[-5:] == [2] * 5 and len(timed) == 2 + 5 and not engine.has_unfinished()  # 2 prefill steps timed
