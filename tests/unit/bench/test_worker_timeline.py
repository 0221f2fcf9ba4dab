import asyncio

from bench.worker_timeline import engine_use, role_changes, worker_states
from protocol.api import WorkerStatsMsg
from router.metrics import PrometheusMetrics


def _page(*stats: WorkerStatsMsg) -> str:
    async def worker_stats():
        return list(stats)

    return asyncio.run(PrometheusMetrics("m", worker_stats=worker_stats).render()).decode()


def test_each_worker_s_role_load_and_kv_use_are_read_back_from_a_rendered_metrics_page():
    page = _page(
        WorkerStatsMsg(worker_id="prefill-0", role="prefill", pid=1, is_healthy=True, num_running=2, num_waiting=5,
                       num_blocks=10, num_free_blocks=10),
        WorkerStatsMsg(worker_id="decode-0", role="decode", computes_every_prompt=True, pid=2, is_healthy=True,
                       num_running=64, num_waiting=3, num_blocks=10, num_free_blocks=4, decode_step_s=0.0125,
                       prefill_tokens_per_s=31000.4, num_queued_prompt_tokens=2500, num_engine_steps=900,
                       engine_step_seconds=11.25, engine_command_seconds=0.5, longest_recent_step_seconds=0.143,
                       num_alloc_retries=2, num_device_frees=3, step_device_seconds=9.5, step_wait_seconds=8.25,
                       follower_forward_seconds=1.5, follower_call_seconds=0.25, follower_longest_call_seconds=0.04,
                       gc_seconds=0.5, longest_recent_gc_seconds=0.125, follower_gc_seconds=2.0,
                       follower_longest_gc_seconds=0.25))
    assert worker_states(page) == {
        "prefill-0": {"role": "prefill", "running": 2, "waiting": 5, "kv": 0.0, "queued_tokens": 0,
                      "decode_step_ms": 0.0, "prefill_tok_s": 0, "steps": 0, "step_s": 0.0, "command_s": 0.0,
                      "longest_step_ms": 0.0, "alloc_retries": 0, "device_frees": 0, "device_s": 0.0, "wait_s": 0.0,
                      "rank_forward_s": 0.0, "rank_call_s": 0.0, "rank_longest_call_ms": 0.0, "gc_s": 0.0,
                      "gc_longest_ms": 0.0, "rank_gc_s": 0.0, "rank_gc_longest_ms": 0.0},
        "decode-0": {"role": "decode_every_prompt", "running": 64, "waiting": 3, "kv": 0.6, "queued_tokens": 2500,
                     "decode_step_ms": 12.5, "prefill_tok_s": 31000, "steps": 900, "step_s": 11.25, "command_s": 0.5,
                     "longest_step_ms": 143.0, "alloc_retries": 2, "device_frees": 3, "device_s": 9.5, "wait_s": 8.25,
                     "rank_forward_s": 1.5, "rank_call_s": 0.25, "rank_longest_call_ms": 40.0, "gc_s": 0.5,
                     "gc_longest_ms": 125.0, "rank_gc_s": 2.0, "rank_gc_longest_ms": 250.0},
    }
    assert worker_states("# nothing\n") == {}


def test_role_changes_keep_only_the_samples_where_a_role_moved_not_where_a_worker_did_not_answer():
    def sample(t_s, prefill_role, running):
        return {"t_s": t_s, "workers": {"prefill-0": {"role": prefill_role, "running": running},
                                        "decode-0": {"role": "decode", "running": 1}}}

    unanswered = {"t_s": 1.5, "workers": {"prefill-0": {"running": 7}, "decode-0": {"role": "decode", "running": 1}}}
    timeline = [sample(0.0, "prefill", 1), sample(1.0, "prefill", 7), unanswered, sample(2.0, "decode", 0),
                sample(3.0, "decode", 9)]
    assert role_changes(timeline) == [
        {"t_s": 0.0, "roles": {"prefill-0": "prefill", "decode-0": "decode"}},
        {"t_s": 2.0, "roles": {"prefill-0": "decode", "decode-0": "decode"}},
    ]


def test_engine_use_takes_differences_between_samples_and_starts_afresh_after_a_restart():
    def sample(t_s, steps, step_s, command_s, retries=0, running=8):
        return {"t_s": t_s, "workers": {"decode-0": {"running": running, "decode_step_ms": 20.0, "steps": steps,
                                                      "step_s": step_s, "command_s": command_s,
                                                      "alloc_retries": retries, "device_frees": retries}}}

    timeline = [sample(0.0, 100, 2.0, 0.1), {"t_s": 0.5, "workers": {}}, sample(1.0, 130, 2.9, 0.2),
                sample(3.0, 160, 3.5, 0.8, retries=2), sample(4.0, 5, 0.1, 0.0), sample(5.0, 45, 1.0, 0.05)]
    use = engine_use(timeline, "decode-0")
    assert [u["t_s"] for u in use] == [1.0, 3.0, 5.0]  # the restart at 4 s has no interval
    first, second = use[0], use[1]
    assert first["steps_per_s"] == 30 and first["step_share"] == 0.9 and first["command_share"] == 0.1
    assert first["device_share"] == 0.6 and first["alloc_retries"] == 0
    # 30 steps in 2 s of 20 ms: the GPU busy 30% of the time while the engine thread was in steps 30%
    assert second["steps_per_s"] == 15 and second["device_share"] == 0.3 and second["command_share"] == 0.3
    assert second["alloc_retries"] == 2 and second["device_frees"] == 2
    assert use[2]["steps_per_s"] == 40
    assert engine_use(timeline, "prefill-0") == []


def test_engine_use_reads_the_busy_share_from_every_step_s_device_time_where_reported():
    """The median step hides slow ones (a step that waited on another rank's collective): the device seconds
    of every step do not; the waits and the other ranks' loops come as shares of the interval."""
    def sample(t_s, steps, device_s, wait_s, rank_forward_s, rank_call_s):
        return {"t_s": t_s, "workers": {"decode-0": {"decode_step_ms": 20.0, "steps": steps, "step_s": t_s,
                                                      "device_s": device_s, "wait_s": wait_s,
                                                      "rank_forward_s": rank_forward_s, "rank_call_s": rank_call_s,
                                                      "rank_longest_call_ms": 75.0, "gc_s": wait_s / 4,
                                                      "gc_longest_ms": 12.5, "rank_gc_s": rank_call_s * 2,
                                                      "rank_gc_longest_ms": 150.0}}}

    use = engine_use([sample(0.0, 0, 0.0, 0.0, 0.0, 0.0), sample(2.0, 40, 1.5, 1.0, 0.5, 0.25)], "decode-0")
    assert len(use) == 1
    # 20 steps a second of a 20 ms median would read 0.4; the steps' device time says 0.75
    assert use[0]["device_share"] == 0.75 and use[0]["wait_share"] == 0.5
    assert use[0]["rank_forward_share"] == 0.25 and use[0]["rank_call_share"] == 0.125
    assert use[0]["rank_longest_call_ms"] == 75.0
    assert use[0]["gc_share"] == 0.125 and use[0]["rank_gc_share"] == 0.25
    assert use[0]["gc_longest_ms"] == 12.5 and use[0]["rank_gc_longest_ms"] == 150.0


def test_the_command_line_prints_each_worker_s_engine_use_by_mode(tmp_path, capsys):
    import json

    from bench.worker_timeline import main

    def sample(t: float, steps: int) -> dict:
        return {"t_s": t, "workers": {"decode-0": {"running": 4, "decode_step_ms": 10.0, "steps": steps,
                                                    "step_s": steps / 100, "command_s": 0.0}}}

    run = {"modes": {"1p1d": {"phases_s": {"rate 8": 20.0}, "pushes": {"num_pushed": 3},
                              "timeline": [sample(0.0, 0), sample(1.0, 50), sample(2.0, 150)]},
                     "colocated": {"timeline": []}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert main([str(path), "1p1d"]) == 0
    out = capsys.readouterr().out
    assert "== 1p1d" in out and "== colocated" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
    assert [(r[0], r[2], r[3], r[5]) for r in rows] == [("1.0", "50.00", "0.500", "0.500"),
                                                         ("2.0", "100.00", "1.000", "1.000")]


def test_the_summary_takes_medians_by_sequences_running_and_the_largest_longest_figures(tmp_path, capsys):
    import json

    from bench.worker_timeline import main, summarize

    def use(running: int, device_share: float, longest: float) -> dict:
        return {"running": running, "steps_per_s": 50.0, "step_share": 1.0, "device_share": device_share,
                "wait_share": 0.5, "command_share": 0.01, "rank_forward_share": 0.1, "rank_call_share": 0.0,
                "gc_share": 0.0, "rank_gc_share": 0.0, "longest_step_ms": longest, "rank_longest_call_ms": 0.0,
                "gc_longest_ms": 0.0, "rank_gc_longest_ms": 0.0}

    rows = [use(0, 0.0, 1.0), use(2, 0.9, 20.0), use(4, 1.0, 30.0), use(3, 0.95, 10.0), use(14, 0.4, 250.0),
            use(20, 0.8, 100.0)]
    bands = summarize(rows)
    assert [(b["running"], b["intervals"]) for b in bands] == [("1-5", 3), ("12+", 2)]  # none idle, none 6-11
    assert bands[0]["device_share"] == 0.95 and bands[0]["longest_step_ms"] == 30.0
    assert bands[1]["device_share"] == 0.6 and bands[1]["longest_step_ms"] == 250.0

    def sample(t: float, steps: int, running: int) -> dict:
        return {"t_s": t, "workers": {"decode-0": {"running": running, "decode_step_ms": 10.0, "steps": steps,
                                                    "step_s": steps / 100, "command_s": 0.0}}}

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"modes": {"1p1d": {"timeline": [sample(0.0, 0, 2), sample(1.0, 50, 2),
                                                                 sample(2.0, 150, 2)]}}}))
    assert main([str(path), "--summary"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert len(rows) == 1 and rows[0][:3] == ["1-5", "2", "75.000"]  # steps a second: the median of 50 and 100
