import asyncio

from bench.worker_timeline import role_changes, worker_states
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
                       prefill_tokens_per_s=31000.4, num_queued_prompt_tokens=2500))
    assert worker_states(page) == {
        "prefill-0": {"role": "prefill", "running": 2, "waiting": 5, "kv": 0.0, "queued_tokens": 0,
                      "decode_step_ms": 0.0, "prefill_tok_s": 0},
        "decode-0": {"role": "decode_every_prompt", "running": 64, "waiting": 3, "kv": 0.6, "queued_tokens": 2500,
                     "decode_step_ms": 12.5, "prefill_tok_s": 31000},
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
