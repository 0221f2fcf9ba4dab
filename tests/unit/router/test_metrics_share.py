"""Router replicas sharing a port: whichever replica a scrape reaches answers with every replica's counts
summed (router/metrics_share.py), and the totals never go down between scrapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from protocol.api import WorkerStatsMsg
from router.metrics import PrometheusMetrics
from router.metrics_share import sum_expositions


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def _value(text: bytes, name: str, **labels: str) -> float:
    return _samples(text).get((name, tuple(sorted({"model_name": "m", **labels}.items()))), 0.0)


def _finish(metrics: PrometheusMetrics, ttft_s: float, tokens: int = 4) -> None:
    metrics.on_choice_finished(finish_reason="length", num_prompt_tokens=10, num_completion_tokens=tokens,
                               num_cached_tokens=0, time_to_first_token_s=ttft_s, elapsed_s=ttft_s + 0.03 * tokens)


def test_a_scrape_of_either_replica_sums_both(tmp_path: Path):
    async def stats() -> list[WorkerStatsMsg]:
        return [WorkerStatsMsg(worker_id="d0", role="decode", pid=1, is_healthy=True, num_running=3, num_waiting=0,
                               num_blocks=10, num_free_blocks=4)]

    a = PrometheusMetrics("m", worker_stats=stats, shared_dir=tmp_path, replica="router-a")
    b = PrometheusMetrics("m", worker_stats=stats, shared_dir=tmp_path, replica="router-b")
    for _ in range(3):
        _finish(a, 0.004)
    _finish(b, 0.2, tokens=7)
    assert b.shared is not None
    b.shared.publish()  # NOTE: what its interval task does (a's scrape publishes a's own counts)
    for scrape in (asyncio.run(a.render()), asyncio.run(b.render())):
        assert _value(scrape, "pdserve:request_success_total", finished_reason="length") == 4
        assert _value(scrape, "pdserve:generation_tokens_total") == 3 * 4 + 7
        assert _value(scrape, "pdserve:time_to_first_token_seconds_count") == 4
        assert _value(scrape, "pdserve:time_to_first_token_seconds_sum") == 3 * 0.004 + 0.2
        assert _value(scrape, "pdserve:time_to_first_token_seconds_bucket", le="0.005") == 3
        assert _value(scrape, "pdserve:time_to_first_token_seconds_bucket", le="0.25") == 4
        # the workers' gauges once, as the workers said (not summed over the replicas)
        assert _value(scrape, "pdserve:num_requests_running", worker="d0") == 3


def test_totals_never_go_down_whichever_replica_answers(tmp_path: Path):
    replicas = [PrometheusMetrics("m", shared_dir=tmp_path, replica=f"router-{i}") for i in range(3)]
    last = 0.0
    for step in range(12):  # NOTE: each scrape reaches another replica than the one that counted last
        _finish(replicas[step % 3], 0.01)
        total = _value(asyncio.run(replicas[(step + 1) % 3].render()), "pdserve:request_success_total",
                       finished_reason="length")
        assert total >= last
        last = total
    # a replica publishes what it counted when it answers a scrape, or at its interval (not run here)
    assert last < 12
    for replica in replicas:
        assert replica.shared is not None
        replica.shared.publish()
    assert _value(asyncio.run(replicas[0].render()), "pdserve:request_success_total", finished_reason="length") == 12


def test_a_replica_alone_answers_with_its_own_counts(tmp_path: Path):
    alone = PrometheusMetrics("m")
    _finish(alone, 0.01)
    assert _value(asyncio.run(alone.render()), "pdserve:request_success_total", finished_reason="length") == 1


def test_sum_keeps_the_earliest_creation_time():
    one = b"# TYPE x counter\nx_total 2.0\nx_created 100.0\n"
    two = b"# TYPE x counter\nx_total 3.0\nx_created 50.0\n"
    summed = _samples(sum_expositions([one.decode(), two.decode()]))
    assert summed[("x_total", ())] == 5.0 and summed[("x_created", ())] == 50.0
