"""The planner on synthetic profiles with known answers: a pool's capacity is its goodput when
requests arrive evenly; a tight TPOT SLO makes disaggregation win (colocated steps carry prefill
chunks), a loose one colocation (every GPU prefills); `pdserve plan` writes the winner's config."""

from __future__ import annotations

import json

import pytest

from cluster.planner import SLO, Layout, StepProfile, Workload, goodput, layouts, plan, requests, simulate
from deploy.schema import ServeAppConfig


def flat(prefill_ms: float, decode_ms: float, **extra: object) -> StepProfile:
    """Every prefill step prefill_ms, every decode step decode_ms, whatever their size."""
    return StepProfile(prefill_tokens=(1, 100_000), prefill_ms=(prefill_ms, prefill_ms), decode_batches=(1, 1024),
                       decode_contexts=(1, 100_000), decode_ms=((decode_ms, decode_ms), (decode_ms, decode_ms)),
                       **extra)


def test_interpolation_is_linear_between_points_and_extrapolates_the_end_segment():
    p = StepProfile(prefill_tokens=(100, 200), prefill_ms=(10.0, 30.0), decode_batches=(1, 9),
                    decode_contexts=(0, 100), decode_ms=((1.0, 2.0), (5.0, 10.0)))
    assert p.prefill_step_ms(150) == pytest.approx(20.0)
    assert p.prefill_step_ms(300) == pytest.approx(50.0)
    assert p.decode_step_ms(5, 50) == pytest.approx((1.5 + 7.5) / 2)
    assert p.decode_step_ms(0, 50) == 0.0 and p.prefill_step_ms(0) == 0.0
    one = StepProfile(prefill_tokens=(128,), prefill_ms=(4.0,), decode_batches=(1,), decode_contexts=(0,),
                      decode_ms=((1.0,),))
    assert one.prefill_step_ms(2560) == pytest.approx(80.0)  # one length measured: in proportion


def test_a_profile_with_mismatched_grids_is_refused_naming_them():
    with pytest.raises(ValueError, match="decode_ms must be"):
        StepProfile(prefill_tokens=(1,), prefill_ms=(1.0,), decode_batches=(1, 2), decode_contexts=(1,),
                    decode_ms=((1.0,),))
    with pytest.raises(ValueError, match="prefill_tokens must be strictly ascending"):
        StepProfile(prefill_tokens=(5, 1), prefill_ms=(1.0, 2.0), decode_batches=(1,), decode_contexts=(1,),
                    decode_ms=((1.0,),))


def test_evenly_spaced_requests_meet_the_slo_up_to_the_prefill_pool_s_capacity():
    """One prefill worker at 100 ms a prompt serves 10 req/s: below, every TTFT is 100 ms; above,
    the queue grows without bound."""
    workload = Workload(prompt_tokens=(500, 500), output_tokens=(5, 5), arrivals="uniform", num_requests=400)
    slo = SLO(ttft_ms=150, tpot_ms=50)
    result = goodput(Layout(1, 1), flat(100.0, 1.0), workload, slo)
    assert 9.9 <= result.goodput <= 10.0
    timings = simulate(Layout(1, 1), flat(100.0, 1.0), requests(workload, 9.0))
    assert all(t.ttft_s == pytest.approx(0.1) for t in timings)
    assert all(t.tpot_s == pytest.approx(0.001) for t in timings)
    assert "TTFT limits it" in result.why


def test_two_prefill_workers_double_the_capacity():
    workload = Workload(prompt_tokens=(500, 500), output_tokens=(5, 5), arrivals="uniform", num_requests=400)
    slo = SLO(ttft_ms=150, tpot_ms=50)
    assert 19.8 <= goodput(Layout(2, 1), flat(100.0, 1.0), workload, slo).goodput <= 20.0


PREFILL_HEAVY = Workload(prompt_tokens=(1000, 1000), output_tokens=(50, 50), num_requests=300)


def test_a_tight_tpot_slo_makes_disaggregation_win():
    """Colocated, a step that carries a prompt takes 50 ms more: every running decode's TPOT pays."""
    plans = plan(2, flat(50.0, 10.0), PREFILL_HEAVY, SLO(ttft_ms=2000, tpot_ms=12))
    assert plans[0].layout == Layout(1, 1)
    colocated = next(p for p in plans if p.layout.num_prefill == 0)
    assert plans[0].goodput > 1.5 * colocated.goodput
    assert "TPOT limits it" in colocated.why


def test_a_loose_tpot_slo_makes_colocation_win():
    """Both GPUs prefill when colocated; 1P1D prefills on one."""
    plans = plan(2, flat(50.0, 10.0), PREFILL_HEAVY, SLO(ttft_ms=2000, tpot_ms=1000))
    assert plans[0].layout == Layout(0, 2)
    assert plans[0].goodput > 1.3 * next(p for p in plans if p.layout == Layout(1, 1)).goodput


def test_layouts_cover_colocated_and_every_split():
    assert [x.name for x in layouts(3)] == ["3 colocated", "1P2D", "2P1D"]
    with pytest.raises(ValueError, match="at least 1 GPU"):
        plan(0, flat(1.0, 1.0), PREFILL_HEAVY, SLO(ttft_ms=1, tpot_ms=1))


def test_pdserve_plan_prints_every_layout_and_writes_the_best_config(tmp_path, capsys):
    from deploy.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(flat(50.0, 10.0).model_dump_json())
    out = tmp_path / "serve.json"
    code = main(["plan", "--gpus", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "12", "--profile", str(profile),
                 "--prompt-tokens", "1000", "1000", "--output-tokens", "50", "50", "--num-requests", "200",
                 "--out", str(out), "--device", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "1P1D" in printed and "2 colocated" in printed and "best: 1P1D" in printed
    config = ServeAppConfig.model_validate(json.loads(out.read_text()))
    assert config.cluster.mode == "disaggregated"
    assert (config.cluster.num_prefill, config.cluster.num_decode) == (1, 1)


def test_layouts_use_every_gpu_with_the_worker_sizes_profiled():
    names = {layout.name for layout in layouts(4, (1, 2))}
    assert names == {"4 colocated", "2 colocated TP2", "3P1D", "2P2D", "1P3D", "2P1D(TP2)", "1P(TP2)2D",
                     "1P(TP2)1D(TP2)"}
    assert all(layout.num_gpus == 4 for layout in layouts(4, (1, 2)))


def test_a_tpot_slo_only_a_tensor_parallel_worker_meets_picks_it():
    # TP=1 decode steps take 30 ms, TP=2 ones 15 ms: under a 20 ms TPOT SLO only TP=2 workers count
    one, two = flat(50.0, 30.0), flat(25.0, 15.0, tensor_parallel_size=2)
    plans = plan(2, {1: one, 2: two}, PREFILL_HEAVY, SLO(ttft_ms=2000, tpot_ms=20))
    assert plans[0].layout == Layout(0, 1, 1, 2) and plans[0].goodput > 0
    assert all(p.goodput == 0 for p in plans if p.layout.decode_tp == 1)
    with pytest.raises(ValueError, match="needs a profile of workers of 2 GPUs"):
        simulate(Layout(0, 1, 1, 2), one, requests(PREFILL_HEAVY, 1.0))


def test_pdserve_plan_takes_a_profile_per_worker_size_and_writes_their_sizes(tmp_path, capsys):
    from deploy.cli import main

    paths = [tmp_path / "tp1.json", tmp_path / "tp2.json"]
    paths[0].write_text(flat(50.0, 30.0).model_dump_json())
    paths[1].write_text(flat(25.0, 15.0, tensor_parallel_size=2).model_dump_json())
    out = tmp_path / "serve.json"
    code = main(["plan", "--gpus", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20", "--profile", *map(str, paths),
                 "--prompt-tokens", "1000", "1000", "--output-tokens", "50", "50", "--num-requests", "200",
                 "--out", str(out), "--device", "cpu"])
    assert code == 0 and "best: 1 colocated TP2" in capsys.readouterr().out
    app = ServeAppConfig.model_validate(json.loads(out.read_text()))
    cluster = app.cluster
    assert (cluster.mode, cluster.num_decode, cluster.decode_tp) == ("colocated", 1, 2)
    assert app.router.model_name == cluster.engine.model.model  # served under the model's name, not 'default'
    paths[1].write_text(flat(25.0, 15.0).model_dump_json())  # both of size 1 now
    with pytest.raises(ValueError, match="tp1.json and .*tp2.json are both of workers of 1 GPUs"):
        main(["plan", "--gpus", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20", "--profile", *map(str, paths),
              "--device", "cpu"])
