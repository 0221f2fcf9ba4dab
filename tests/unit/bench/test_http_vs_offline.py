"""bench.http_vs_offline's figures over request records (one client's, or every client process's of --clients N):
the tokens of the requests that succeeded over the run's span, medians over those requests only."""

from __future__ import annotations

import pytest

from bench.http_vs_offline import _figures
from loadgen.metrics import compute_metrics
from loadgen.records import RequestRecord


def test_figures_count_the_good_requests_over_the_span_of_every_client():
    good = [RequestRecord(index=i, max_tokens=5, send_time=10.0 + i, end_time=12.0 + i,
                          chunk_times=(10.5 + i, 12.0 + i), completion_tokens=5, is_success=True) for i in range(3)]
    failed = RequestRecord(index=9, max_tokens=5, send_time=10.0, end_time=10.1, error="refused")
    figures = _figures(compute_metrics([*good, failed], 14.0 - 10.0))
    assert figures["output_tokens"] == 15 and figures["output_tok_per_s"] == pytest.approx(15 / 4.0)
    assert (figures["num_completed"], figures["num_errored"]) == (3, 1)
    assert figures["ttft_median_ms_at_256_streams"] == pytest.approx(500.0)
    assert figures["tpot_median_ms_at_256_streams"] == pytest.approx((2.0 - 0.5) / 4 * 1e3)


def test_a_client_shard_opens_its_connections_with_its_requests_cut_short_before_the_common_start(
        tmp_path, monkeypatch, capsys):
    import argparse
    import json
    import time

    import bench.http_vs_offline as hvo
    import loadgen.cli
    from bench.http_vs_offline import _config, client_shard_main
    from tests.fake_stream_client import FakeStreamClient

    client = FakeStreamClient()
    monkeypatch.setattr(loadgen.cli, "client_for", lambda config, **kw: client)
    shard = tmp_path / "shard0.jsonl"
    _config("http://127.0.0.1:1/v1", "m", 100, [[1, 2, 3], [4, 5]], [40, 50], shard)
    monkeypatch.setattr(hvo, "WARM_LEAD_S", 0.3)
    start_at = time.perf_counter() + 0.6
    client_shard_main(argparse.Namespace(client_shard=shard, base_url="http://127.0.0.1:1/v1", served_model="m",
                                         vocab=100, start_at=start_at))
    sent = [(request.max_tokens, when) for request, when in client.sent]
    # warm, within the lead before the start: a connection idle 15 s is closed by aiohttp
    assert [m for m, _ in sent[:2]] == [16, 16] and all(start_at - 0.3 <= t < start_at for _, t in sent[:2])
    assert sorted(m for m, _ in sent[2:]) == [40, 50] and all(t >= start_at for _, t in sent[2:])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(printed["records"]) == 2 and printed["started"] >= start_at


def test_the_server_s_counts_over_the_run_give_its_cache_hits_and_each_worker_s_steps(monkeypatch):
    import bench.http_vs_offline as hvo

    def page(prompt, hit, steps, seconds):
        return "\n".join([
            "# HELP pdserve:prompt_tokens_total Prompt tokens.",
            f'pdserve:prompt_tokens_total{{model_name="m"}} {prompt}',
            f'pdserve:prefix_cache_hit_tokens_total{{model_name="m"}} {hit}',
            f'pdserve:time_to_first_token_seconds_sum{{model_name="m"}} {seconds * 4}',
            f'pdserve:time_to_first_token_seconds_count{{model_name="m"}} {steps // 10}',
            f'pdserve:engine_steps{{model_name="m",worker="d0"}} {steps}',
            f'pdserve:worker_requests_joined{{model_name="m",worker="d0"}} {steps // 10}',
            f'pdserve:engine_step_seconds{{model_name="m",worker="d0"}} {seconds}',
            f'pdserve:engine_steps{{model_name="m",worker="d1"}} {steps + 10}',
            f'pdserve:engine_step_seconds{{model_name="m",worker="d1"}} {seconds}',
            'pdserve:engine_steps_created{model_name="m",worker="d1"} 1.7e9',
        ])

    pages = iter([page(1000, 100, 50, 1.0), page(3000, 1700, 150, 1.5)])
    monkeypatch.setattr(hvo, "scrape_metrics", lambda base: next(pages))
    before, after = hvo.served_counts("http://x/v1"), hvo.served_counts("http://x/v1")
    assert before["pdserve:time_to_first_token_seconds_count"] == 5.0
    figures = hvo._served_figures(before, after, wall_s=2.0)
    assert figures["prefix_cache_hit_share"] == pytest.approx(1600 / 2000)
    assert figures["router_ttft_mean_ms_during_run"] == pytest.approx((6.0 - 4.0) / (15 - 5) * 1e3)
    d0 = figures["workers_during_run"]["d0"]
    assert d0["requests"] == 10 and d0["steps"] == 100 and d0["step_ms_mean"] == pytest.approx(5.0)
    assert d0["device_ms_mean"] == 0.0
    assert d0["in_steps_share_of_run"] == pytest.approx(0.25)
    assert set(figures["workers_during_run"]) == {"d0", "d1"}
