"""PrometheusMetrics' KV-push figures: each answer counts the bytes its push sends; the pushes'
outcomes and seconds come per prefill worker from its stats (WorkerStatsMsg.push_totals), as gauges."""

from __future__ import annotations

import asyncio

from protocol.api import WorkerStatsMsg
from protocol.messages import PrefillResultMsg, PushTotalsMsg
from router.metrics import PrometheusMetrics


def _lines(text: bytes) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
            if line and not line.startswith("#")}


def test_push_bytes_from_the_answers_and_the_rest_from_the_workers_stats():
    async def worker_stats():
        load = dict(pid=1, is_healthy=True, num_running=0, num_waiting=0, num_blocks=10, num_free_blocks=4)
        totals = PushTotalsMsg(num_pushed=7, num_failed=2, num_cancelled=3, push_bytes=9000, push_seconds=0.035,
                               send_device_seconds=0.006)
        return [WorkerStatsMsg(worker_id="p0", role="prefill", push_totals=totals, **load),
                WorkerStatsMsg(worker_id="d0", role="decode", num_leases=1, **load)]

    metrics = PrometheusMetrics("m", worker_stats=worker_stats)
    metrics.on_prefill_result(PrefillResultMsg(request_id="a", push_bytes=1000))
    metrics.on_prefill_result(PrefillResultMsg(request_id="b", push_bytes=500))
    metrics.on_prefill_result(PrefillResultMsg(request_id="c", finish_reason="stop"))  # nothing to push
    lines = _lines(asyncio.run(metrics.render()))
    assert lines['pdserve:kv_transfer_bytes_total{model_name="m"}'] == 1500
    assert lines['pdserve:kv_pushes{model_name="m",worker="p0"}'] == 7
    assert lines['pdserve:kv_push_failures{model_name="m",worker="p0"}'] == 2
    assert lines['pdserve:kv_push_seconds{model_name="m",worker="p0"}'] == 0.035
    assert lines['pdserve:kv_push_send_device_seconds{model_name="m",worker="p0"}'] == 0.006
    assert lines['pdserve:kv_push_cancellations{model_name="m",worker="p0"}'] == 3
    assert 'pdserve:kv_pushes{model_name="m",worker="d0"}' not in lines
    assert lines['pdserve:kv_leases{model_name="m",worker="d0"}'] == 1
    assert lines['pdserve:kv_cache_usage_perc{model_name="m",worker="p0"}'] == 0.6


def test_each_worker_s_role_now_and_not_before():
    load = dict(pid=1, is_healthy=True, num_running=0, num_waiting=0, num_blocks=10, num_free_blocks=4)
    rows = [WorkerStatsMsg(worker_id="prefill-0", role="prefill", **load),
            WorkerStatsMsg(worker_id="decode-0", role="decode", **load)]

    async def worker_stats():
        return rows

    metrics = PrometheusMetrics("m", worker_stats=worker_stats)
    lines = _lines(asyncio.run(metrics.render()))
    assert lines['pdserve:worker_role{model_name="m",role="prefill",worker="prefill-0"}'] == 1
    assert lines['pdserve:worker_role{model_name="m",role="decode",worker="decode-0"}'] == 1
    # prefill-0 became a decode worker and, with no prefill worker left, both compute every prompt
    rows = [WorkerStatsMsg(worker_id=w, role="decode", computes_every_prompt=True, **load)
            for w in ("prefill-0", "decode-0")]
    lines = _lines(asyncio.run(metrics.render()))
    roles = {k: v for k, v in lines.items() if k.startswith("pdserve:worker_role")}
    assert roles == {'pdserve:worker_role{model_name="m",role="decode_every_prompt",worker="prefill-0"}': 1,
                     'pdserve:worker_role{model_name="m",role="decode_every_prompt",worker="decode-0"}': 1}


def test_each_worker_s_engine_thread_allocator_and_draft_gate_counters_are_gauges():
    async def worker_stats():
        return [WorkerStatsMsg(worker_id="d0", role="decode", pid=1, is_healthy=True, num_running=3, num_waiting=0,
                               num_blocks=10, num_free_blocks=4, num_engine_steps=1200, engine_step_seconds=14.5,
                               engine_command_seconds=0.75, longest_recent_step_seconds=0.18,
                               num_alloc_retries=4, num_device_frees=9, step_device_seconds=12.5,
                               step_wait_seconds=10.25, grammar_work_seconds=2.5, follower_forward_seconds=1.5,
                               follower_call_seconds=0.5,
                               follower_longest_call_seconds=0.125, gc_seconds=0.75,
                               longest_recent_gc_seconds=0.0625, follower_gc_seconds=1.25,
                               follower_longest_gc_seconds=0.25, num_requests=77, num_spec_gate_overturns=3)]

    lines = _lines(asyncio.run(PrometheusMetrics("m", worker_stats=worker_stats).render()))
    assert lines['pdserve:engine_steps{model_name="m",worker="d0"}'] == 1200
    assert lines['pdserve:worker_requests_joined{model_name="m",worker="d0"}'] == 77
    assert lines['pdserve:spec_decode_gate_overturns{model_name="m",worker="d0"}'] == 3
    assert lines['pdserve:engine_step_seconds{model_name="m",worker="d0"}'] == 14.5
    assert lines['pdserve:engine_command_seconds{model_name="m",worker="d0"}'] == 0.75
    assert lines['pdserve:engine_longest_recent_step_seconds{model_name="m",worker="d0"}'] == 0.18
    assert lines['pdserve:cuda_alloc_retries{model_name="m",worker="d0"}'] == 4
    assert lines['pdserve:cuda_device_frees{model_name="m",worker="d0"}'] == 9
    assert lines['pdserve:engine_step_device_seconds{model_name="m",worker="d0"}'] == 12.5
    assert lines['pdserve:engine_step_wait_seconds{model_name="m",worker="d0"}'] == 10.25
    assert lines['pdserve:grammar_work_seconds{model_name="m",worker="d0"}'] == 2.5
    assert lines['pdserve:rank_forward_seconds{model_name="m",worker="d0"}'] == 1.5
    assert lines['pdserve:rank_call_seconds{model_name="m",worker="d0"}'] == 0.5
    assert lines['pdserve:rank_longest_recent_call_seconds{model_name="m",worker="d0"}'] == 0.125
    assert lines['pdserve:gc_pause_seconds{model_name="m",worker="d0"}'] == 0.75
    assert lines['pdserve:gc_longest_recent_pause_seconds{model_name="m",worker="d0"}'] == 0.0625
    assert lines['pdserve:rank_gc_pause_seconds{model_name="m",worker="d0"}'] == 1.25
    assert lines['pdserve:rank_gc_longest_recent_pause_seconds{model_name="m",worker="d0"}'] == 0.25


def test_a_worker_that_left_or_did_not_answer_keeps_no_series():
    load = dict(pid=1, is_healthy=True, num_running=0, num_waiting=0, num_blocks=10, num_free_blocks=4)
    answers: list = [[WorkerStatsMsg(worker_id="p0", role="prefill", **load),
                      WorkerStatsMsg(worker_id="d0", role="decode", num_leases=2, **load)],
                     [WorkerStatsMsg(worker_id="d0", role="decode", num_leases=1, **load)],  # p0 retired
                     RuntimeError("the stats call failed")]

    async def worker_stats():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    metrics = PrometheusMetrics("m", worker_stats=worker_stats)
    assert any('worker="p0"' in k for k in _lines(asyncio.run(metrics.render())))
    lines = _lines(asyncio.run(metrics.render()))
    assert not any('worker="p0"' in k for k in lines), [k for k in lines if "p0" in k]
    assert lines['pdserve:kv_leases{model_name="m",worker="d0"}'] == 1
    lines = _lines(asyncio.run(metrics.render()))  # no answer: no worker series, rather than stale ones
    assert not any('worker="' in k for k in lines), [k for k in lines if "worker=" in k]
