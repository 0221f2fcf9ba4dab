"""PrometheusMetrics' KV-push figures: an answer sent before its push counts the push's bytes but
not its seconds (not known yet); the pushes that end after their answers come per prefill worker
from its stats, as gauges."""

from __future__ import annotations

import asyncio

from kvtransfer.protocol import PrefillResultMsg
from router.metrics import PrometheusMetrics


def _lines(text: bytes) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
            if line and not line.startswith("#")}


def test_push_seconds_only_when_the_answer_waited_and_the_rest_from_the_workers_stats():
    async def worker_stats():
        return [{"worker_id": "p0", "num_kv_pushes_after_answer": 7, "num_kv_push_failures_after_answer": 2,
                 "kv_push_seconds_after_answer": 0.035}]

    metrics = PrometheusMetrics("m", worker_stats=worker_stats)
    metrics.on_prefill_result(PrefillResultMsg(request_id="a", push_bytes=1000, push_s=0.002))
    metrics.on_prefill_result(PrefillResultMsg(request_id="b", push_bytes=500, push_pending=True))
    lines = _lines(asyncio.run(metrics.render()))
    assert lines['pdserve:kv_transfer_bytes_total{model_name="m"}'] == 1500
    assert lines['pdserve:kv_transfer_seconds_count{model_name="m"}'] == 1  # only the answer that waited
    assert lines['pdserve:kv_transfer_seconds_sum{model_name="m"}'] == 0.002
    assert lines['pdserve:kv_pushes_after_answer{model_name="m",worker="p0"}'] == 7
    assert lines['pdserve:kv_push_failures_after_answer{model_name="m",worker="p0"}'] == 2
    assert lines['pdserve:kv_push_seconds_after_answer{model_name="m",worker="p0"}'] == 0.035
