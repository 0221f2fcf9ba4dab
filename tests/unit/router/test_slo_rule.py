"""Conditional disaggregation per request (router.policy.SloRule) on constructed queue states: the
prompt goes to a decode worker only when its first token comes sooner there without breaking the
TPOT SLO; until the workers have measured their speed, short_or_cached decides. And the speed
figures the rule reads: engine.step_rates and EngineStats."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from engine import LLM, SamplingParams
from engine.step_rates import StepRates
from router.dispatch import DispatcherConfig, LocalPrefillConfig, SloConfig
from router.policy import SloRule, WorkerLoad, create_prefill_rule

PROMPT = list(range(1000))


def _prefill(queued: int = 0, rate: float = 10_000.0) -> WorkerLoad:
    # 1,000 tokens take 0.1 s to prefill there, and their KV (1 kB a token) 1 ms to push at 1 GB/s
    return WorkerLoad("p0", role="prefill", num_queued_prompt_tokens=queued, prefill_tokens_per_s=rate,
                      kv_bytes_per_token=1000, push_bytes_per_s=1e9)


def _decode(worker_id: str = "d0", step_s: float = 0.02, rate: float = 5_000.0, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id, num_running=10, role="decode", num_queued_prompt_tokens=queued,
                      decode_step_s=step_s, prefill_tokens_per_s=rate)


def _rule(*loads: WorkerLoad, step_s: float = 0.04, **options: Any) -> SloRule:
    rule = create_prefill_rule("slo", loads={w.worker_id: w for w in loads}, step_s=step_s, block_size=16, **options)
    assert isinstance(rule, SloRule)
    return rule


def test_an_idle_prefill_worker_wins_over_chunks_squeezed_into_a_busy_decode_batch():
    rule = _rule(_prefill(), _decode())
    # remote: 0.1 s + 1 ms; local: 0.02 s of room a 40 ms step = 100 tokens a step, 10 steps = 0.4 s
    assert rule.remote_ttft_s(1000) == pytest.approx(0.101)
    assert rule.local_ttft_s("d0", 1000) == pytest.approx(0.4)
    assert rule.local_workers(PROMPT, ["d0"]) == ([], 0)


def test_a_long_prefill_queue_sends_the_prompt_to_the_decode_worker():
    rule = _rule(_prefill(queued=20_000), _decode())
    assert rule.remote_ttft_s(1000) == pytest.approx(2.101)
    assert rule.local_workers(PROMPT, ["d0"]) == (["d0"], 0)


def test_a_decode_worker_whose_step_breaks_the_tpot_slo_takes_no_prompt():
    rule = _rule(_prefill(queued=1_000_000), _decode(step_s=0.05))
    assert rule.local_ttft_s("d0", 1000) == float("inf")
    assert rule.local_workers(PROMPT, ["d0"]) == ([], 0)


def test_a_decode_worker_with_a_full_batch_takes_no_prompt():
    # a long prefill queue (2.1 s) would send the prompt local, but the batch is at max_num_seqs: the
    # prompt would wait there for a sequence to end before its first token
    full = WorkerLoad("d0", num_running=60, num_waiting=4, role="decode", decode_step_s=0.02,
                      prefill_tokens_per_s=5_000.0, max_num_seqs=64)
    rule = _rule(_prefill(queued=20_000), full)
    assert rule.local_ttft_s("d0", 1000) == float("inf")
    assert rule.local_workers(PROMPT, ["d0"]) == ([], 0)
    rule.loads = {"p0": _prefill(queued=20_000), "d0": dataclasses.replace(full, num_waiting=3)}
    assert rule.local_workers(PROMPT, ["d0"]) == (["d0"], 0)  # one place left


def test_a_prompt_the_decode_worker_holds_in_its_cache_is_cheap_there():
    rule = _rule(_prefill(), _decode())
    rule.on_cached("d0", PROMPT)
    assert rule.local_ttft_s("d0", 1000 - 62 * 16) == pytest.approx(0.04)  # 8 uncached tokens: one step
    assert rule.local_workers(PROMPT, ["d0"]) == (["d0"], 0)


def test_the_soonest_decode_worker_comes_first_and_only_those_that_beat_the_remote_path():
    rule = _rule(_prefill(queued=20_000), _decode("d0", queued=3000), _decode("d1"), _decode("d2", step_s=0.039))
    # d1: 10 steps (0.4 s); d0: 40 steps (1.6 s); d2: 1,000 steps: slower than remote (2.1 s)
    assert rule.local_workers(PROMPT, ["d0", "d1", "d2"]) == (["d1", "d0"], 0)


def test_prompts_sent_since_a_worker_last_reported_count_in_its_queue():
    now = [10.0]
    loads = {"p0": _prefill(), "d0": _decode()}
    rule = _rule(*loads.values(), clock=lambda: now[0])
    rule.loads = loads
    # A burst against reports asked for at t=0: remote 0.1 s, 0.2 s, 0.3 s, 0.4 s (1,000 tokens more each)
    # until local (0.4 s: 10 steps of 100 tokens) is no slower; then local takes one (its queue grows)
    picks = [rule.local_workers(PROMPT, ["d0"])[0] for _ in range(5)]
    assert picks == [[], [], [], ["d0"], []]
    assert rule.queued_tokens(loads["p0"]) == 4000 and rule.queued_tokens(loads["d0"]) == 1000
    # a report asked for after those were sent includes them: they are no longer added
    now[0] = 11.0
    loads["p0"] = WorkerLoad("p0", role="prefill", num_queued_prompt_tokens=2500, prefill_tokens_per_s=10_000.0,
                             kv_bytes_per_token=1000, push_bytes_per_s=1e9, fetched_at=10.5)
    assert rule.queued_tokens(loads["p0"]) == 2500
    assert rule.remote_ttft_s(1000) == pytest.approx(0.351)


def test_a_burst_without_fresh_reports_goes_one_way_only_as_far_as_the_estimates_allow():
    rule = _rule(_prefill(), _decode("d0"), _decode("d1"))
    picks = ["".join(rule.local_workers(PROMPT, ["d0", "d1"])[0][:1]) or "remote" for _ in range(12)]
    # remote until its queue makes it as slow as a decode worker's 10 chunked steps (0.4 s), then each
    # decode worker once, then remote again until 0.8 s (20 steps), ...
    assert picks == ["remote"] * 3 + ["d0", "d1"] + ["remote"] * 4 + ["d0", "d1", "remote"]


def test_a_decode_worker_that_never_prefilled_is_estimated_at_the_measured_prefill_rate():
    # every prompt so far went remote, so d0 has a decode step time but no prefill rate of its own
    rule = _rule(_prefill(queued=20_000), _decode(rate=0.0))
    # 0.02 s of room at the prefill worker's 10,000 tokens/s: 200 tokens a step, 5 steps = 0.2 s
    assert rule.local_ttft_s("d0", 1000) == pytest.approx(0.2)
    assert rule.local_workers(PROMPT, ["d0"]) == (["d0"], 0)


def test_until_speeds_are_measured_short_or_cached_decides():
    rule = _rule(_prefill(rate=0.0), _decode(), max_short_prompt_tokens=192)
    assert rule.local_workers(list(range(100)), ["d0"]) == (["d0"], 0)  # short
    assert rule.local_workers(PROMPT, ["d0"]) == ([], 0)


def test_the_slo_rule_needs_a_tpot_slo_named():
    with pytest.raises(ValidationError, match="slo.tpot_ms"):
        DispatcherConfig(local_prefill=LocalPrefillConfig(rule="slo"))
    config = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="slo"), slo=SloConfig(tpot_ms=40))
    assert config.slo.tpot_ms == 40
    with pytest.raises(ValueError, match="needs a TPOT SLO"):
        create_prefill_rule("slo")


def test_step_rates_split_a_prefill_step_into_its_decode_part_and_its_prompt_tokens():
    rates = StepRates()
    rates.observe(0.010, 0, 8)
    rates.observe(0.012, 0, 8)
    assert rates.decode_step_s == pytest.approx(0.011)
    rates.observe(0.031, 1000, 8)  # 0.020 s of prompt work
    assert rates.prefill_tokens_per_s == pytest.approx(50_000)
    rates.observe(0.040, 2000, 0)  # no decode part
    assert rates.prefill_tokens_per_s == pytest.approx(50_000)


def test_an_engine_reports_its_speed_and_queue(make_llm):
    llm: LLM = make_llm(num_blocks=64)
    engine = llm.engine
    engine.add_request("a", list(range(5, 60)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("b", list(range(70, 90)), SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.stats().num_queued_prompt_tokens == 55 + 20
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.num_queued_prompt_tokens == 0
    assert stats.decode_step_s > 0 and stats.prefill_tokens_per_s > 0
    arch = engine.arch
    assert stats.kv_bytes_per_token == 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # float32
    assert stats.load()["max_num_seqs"] == engine.config.scheduler.max_num_seqs > 0  # the autoscaler's batch cap


def test_a_dispatcher_with_the_slo_rule_feeds_it_the_workers_loads():
    from router import Dispatcher, Workers

    config = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="slo"), slo=SloConfig(tpot_ms=25))
    dispatcher = Dispatcher("router-0", Workers(prefill={}, decode={}), config=config)
    rule = dispatcher.prefill_rule
    assert isinstance(rule, SloRule) and rule.step_s == pytest.approx(0.8 * 0.025)  # STEP_SHARE
    assert rule.loads is dispatcher.loads.loads  # what the load tracker refreshes from the workers' stats
