"""bench.planner_replay: a run's modes become the planner's layouts (worker sizes from the run's --tp unless the
mode names its own; adaptive modes are not replayed), and each static mode's recorded requests are replayed
through the simulation with the profiles of its worker sizes."""

from __future__ import annotations

import pytest

from bench.planner_replay import goodputs, replay, run_tp, static_layout
from cluster.planner import StepProfile
from cluster.planner.simulate import Layout


@pytest.mark.parametrize("mode,tp,layout", [
    ("2p2d-tp1x1", 2, Layout(2, 2, 1, 1)),
    ("colocated2", 2, Layout(0, 2, 2, 2)),
    ("3p1d", 1, Layout(3, 1, 1, 1)),
    ("2p1d-tp1x2", 2, Layout(2, 1, 1, 2)),
    ("disagg", 1, Layout(1, 1, 1, 1)),
    ("colocated", 1, Layout(0, 2, 1, 1)),
])
def test_modes_become_the_planner_layouts(mode: str, tp: int, layout: Layout) -> None:
    assert static_layout(mode, tp) == layout


def test_adaptive_modes_are_not_replayed() -> None:
    assert static_layout("adaptive1p1d", 2) is None and static_layout("adaptive", 1) is None


def _profile(size: int, step_ms: float) -> StepProfile:
    return StepProfile(prefill_tokens=(1, 10_000), prefill_ms=(step_ms, step_ms), decode_batches=(1, 64),
                       decode_contexts=(1, 10_000), decode_ms=((step_ms, step_ms), (step_ms, step_ms)),
                       max_num_seqs=64, tensor_parallel_size=size)


def test_each_layout_is_simulated_with_its_worker_sizes_profiles() -> None:
    records = [{"ok": True, "send_s": 0.1 * i, "in": 100, "out": 11, "ttft_ms": 50.0, "tpot_ms": 12.0}
               for i in range(5)]
    run = {"config": {"engine_flags": ["--tensor-parallel-size", "2"]},
           "requests": {"colocated2": [{"rate": 10.0, "records": records}],
                        "2p1d-tp1x2": [{"rate": 10.0, "records": records}],
                        "adaptive1p1d": [{"rate": 10.0, "records": records}]}}
    assert run_tp(run) == 2 and run_tp({}) == 1
    rows = replay(run, {1: _profile(1, 4.0), 2: _profile(2, 2.0)}, (1000.0, 40.0))
    assert [(r["layout"], r["requests"]) for r in rows] == [("2 colocated TP2", 5), ("2P1D(TP2)", 5)]
    # a TP=2 decode step of 2 ms: ten steps after the first token, whichever layout decodes
    assert all(r["predicted"]["tpot_p90_ms"] == pytest.approx(2.0) for r in rows)
    assert all(r["measured"]["tpot_p90_ms"] == 12.0 for r in rows)
    with pytest.raises(ValueError, match="profile of workers of 1 GPUs"):
        replay(run, {2: _profile(2, 2.0)}, (1000.0, 40.0))


def test_goodput_by_one_rule_from_the_measured_and_the_replayed_attainments() -> None:
    def row(layout: str, rate: float, measured: float, predicted: float) -> dict:
        return {"layout": layout, "rate": rate, "measured": {"attainment": measured},
                "predicted": {"attainment": predicted}}

    rows = [row("2P2D", 3.0, 0.8, 0.8), row("2P2D", 2.0, 1.0, 1.0), row("3P1D", 2.0, 1.0, 1.0),
            row("3P1D", 3.0, 0.89, 1.0), row("3P1D", 4.0, 0.93, 0.95)]
    assert goodputs(rows) == {"2P2D": {"measured": 2.0, "predicted": 2.0},
                              "3P1D": {"measured": 2.0, "predicted": 4.0}}
