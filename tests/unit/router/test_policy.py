"""Dispatch policies: cache-aware prefill choice, load-aware decode choice, round robin, registry;
prefill rules (which prompts their decode worker computes itself) and their configuration."""

from __future__ import annotations

import asyncio

import pytest

from protocol.api import WorkerStatsMsg
from router.policy import CacheAwarePolicy, LoadTracker, WorkerLoad, create_prefill_rule


def test_prefill_goes_where_the_prefix_was_sent():
    policy = CacheAwarePolicy(block_size=4)
    shared = list(range(100, 140))
    policy.on_assigned("p1", shared + [1, 2, 3])
    assert policy.prefill_order(shared + [9, 9, 9, 9], ["p0", "p1", "p2"])[0] == "p1"
    # no cached prefix anywhere: the shortest queue wins
    policy.loads = {"p0": WorkerLoad("p0", num_waiting=5), "p1": WorkerLoad("p1", num_waiting=9),
                    "p2": WorkerLoad("p2", num_waiting=1)}
    assert policy.prefill_order(list(range(500, 540)), ["p0", "p1", "p2"])[0] == "p2"


def test_one_prefill_worker_is_chosen_without_hashing_and_the_prompt_is_noted_after():
    """The Dispatcher asks for the order before the prefill call and tells on_prompt after it has
    gone: with one candidate the prompt is not hashed before the call at all."""
    policy = CacheAwarePolicy(block_size=4)
    shared = list(range(100, 140))
    assert policy.prefill_order(shared + [1], ["p0"]) == ["p0"]
    assert policy._hashed is None  # nothing hashed on the way to the call
    policy.on_assigned("p0", None)
    assert policy.assigned == {"p0": 1} and policy.prefix.match_blocks("p0", policy.prefix.hashes(shared)) == 0
    policy.on_prompt("p0", shared + [1])
    assert policy.prefix.match_blocks("p0", policy.prefix.hashes(shared)) == len(shared) // 4
    assert policy.prefill_order(shared + [9], ["p1", "p0"])[0] == "p0"


def test_decode_by_room_then_running_batch_then_free_blocks():
    loads = {"d0": WorkerLoad("d0", num_running=3, num_free_blocks=100, num_blocks=1000),
             "d1": WorkerLoad("d1", num_running=1, num_free_blocks=500, num_blocks=1000),
             "d2": WorkerLoad("d2", num_running=0, num_free_blocks=500, num_blocks=1000),
             "full": WorkerLoad("full", num_running=0, num_free_blocks=10, num_blocks=1000)}
    policy = CacheAwarePolicy(loads=loads)
    assert policy.decode_order(10, ["full", "d0", "d1", "d2"]) == ["d2", "d1", "d0", "full"]
    policy.on_assigned("d2", None)
    policy.on_assigned("d2", None)  # pending work this router sent counts until the next refresh
    assert policy.decode_order(10, ["d0", "d1", "d2"])[:2] == ["d1", "d2"]
    policy.on_finished("d2")
    policy.on_finished("d2")
    assert policy.decode_order(10, ["d0", "d1", "d2"])[0] == "d2"


def test_colocated_by_the_prompt_tokens_to_compute_before_this_prompt_not_by_request_counts():
    now = [10.0]
    # c0 runs fewer requests but has two 4,000-token prompts queued; c1 runs more with 1,500 queued
    loads = {"c0": WorkerLoad("c0", num_running=2, num_waiting=2, num_queued_prompt_tokens=8000, fetched_at=9.9,
                              num_free_blocks=500, num_blocks=1000),
             "c1": WorkerLoad("c1", num_running=6, num_waiting=3, num_queued_prompt_tokens=1500, fetched_at=9.9,
                              num_free_blocks=500, num_blocks=1000)}
    policy = CacheAwarePolicy(loads=loads, clock=lambda: now[0])
    prompt = list(range(3000))
    assert policy.colocated_order(prompt, ["c0", "c1"]) == ["c1", "c0"]
    assert policy.decode_order(len(prompt), ["c0", "c1"]) == ["c0", "c1"]  # by counts: the lease placement's order
    # sent since the reports were asked for count: c1 holds 1,500 + 3,000, then + 4,000 = 8,500 > c0's 8,000
    policy.on_sent("c1", prompt)
    assert policy.sent.queued_tokens(loads["c1"]) == 4500
    policy.on_sent("c1", list(range(5000, 9000)))
    assert policy.colocated_order(prompt, ["c0", "c1"]) == ["c0", "c1"]  # 8,000 vs 8,500 queued
    # a later report includes them: only what it says counts
    loads["c1"] = WorkerLoad("c1", num_running=8, num_queued_prompt_tokens=2000, fetched_at=10.5,
                             num_free_blocks=500, num_blocks=1000)
    assert policy.colocated_order(prompt, ["c0", "c1"]) == ["c1", "c0"]


def test_colocated_prefers_the_worker_believed_to_hold_the_prompt_s_prefix():
    policy = CacheAwarePolicy(block_size=16)
    history = list(range(100, 2100))  # a conversation's first 2,000 tokens went to c1
    policy.on_prompt("c1", history)
    follow_up = history + list(range(5000, 5100))
    assert policy.colocated_order(follow_up, ["c0", "c1"])[0] == "c1"  # 100 uncached tokens against 2,100
    policy.on_sent("c1", follow_up)
    assert policy.sent.queued_tokens(WorkerLoad("c1")) == 2100 - 125 * 16  # only its uncached part is queued
    full = WorkerLoad("c1", num_free_blocks=1, num_blocks=1000)
    assert CacheAwarePolicy(loads={"c1": full}).colocated_order(follow_up, ["c1", "c0"])[0] == "c0"  # no room


def test_ties_rotate():
    policy = CacheAwarePolicy()
    firsts = {policy.decode_order(1, ["a", "b", "c"])[0] for _ in range(3)}
    assert firsts == {"a", "b", "c"}


def test_load_tracker_refreshes_and_drops_gone_workers():
    async def main():
        calls = []

        async def fetch(worker_id):
            calls.append(worker_id)
            if worker_id == "dead":
                raise RuntimeError("gone")
            return WorkerStatsMsg(worker_id=worker_id, role="decode", pid=1, is_healthy=True, num_running=2,
                                  num_waiting=1, num_free_blocks=7, num_blocks=9, max_num_seqs=64)

        tracker = LoadTracker(fetch, interval_s=0.01, clock=lambda: 5.0)
        tracker.track(["a", "dead"])
        await asyncio.sleep(0.1)
        expected = WorkerLoad("a", 2, 1, 7, 9, "decode", fetched_at=5.0, max_num_seqs=64)  # fetched_at: call sent
        assert tracker.loads["a"] == expected and "dead" not in tracker.loads
        tracker.track(["b"])
        for _ in range(500):  # NOTE: polled, at most 5 s: one fixed 0.1 s sleep lost to a loaded CI machine once
            if set(tracker.loads) == {"b"}:
                break
            await asyncio.sleep(0.01)
        assert set(tracker.loads) == {"b"}
        tracker.close()

    asyncio.run(main())


def test_short_or_cached_rule_picks_short_prompts_and_prompts_a_decode_worker_mostly_holds():
    rule = create_prefill_rule("short_or_cached", max_short_prompt_tokens=8, min_cached_fraction=0.75, block_size=4)
    assert rule.local_workers([1, 2, 3], ["d0", "d1"]) == (["d0", "d1"], 0)  # short: any, no condition
    held = list(range(100, 124))  # 6 blocks
    assert rule.local_workers(held + [1, 2], ["d0", "d1"]) == ([], 20)  # long, cached nowhere
    rule.on_cached("d1", held)
    assert rule.local_workers(held + [1, 2], ["d0", "d1"]) == (["d1"], 20)  # 24 of 26 tokens there
    assert rule.local_workers(held + list(range(12)), ["d0", "d1"]) == ([], 27)  # 24 of 36: not most
    rule.forget("d1")
    assert rule.local_workers(held + [1, 2], ["d0", "d1"]) == ([], 20)
    remote = create_prefill_rule("remote", max_short_prompt_tokens=8)
    assert remote.local_workers([1, 2, 3], ["d0"]) == ([], 0)
    with pytest.raises(ValueError, match="prefill rule 'nearest' is unknown; known: remote, short_or_cached"):
        create_prefill_rule("nearest")


def test_local_prefill_config_is_validated():
    from pydantic import ValidationError

    from router import DispatcherConfig, LocalPrefillConfig

    assert DispatcherConfig().local_prefill.rule == "short_or_cached"
    with pytest.raises(ValidationError,
                       match="local_prefill.rule 'nearest' is unknown; known: remote, short_or_cached"):
        LocalPrefillConfig(rule="nearest")
    with pytest.raises(ValidationError, match="min_cached_fraction"):
        LocalPrefillConfig(min_cached_fraction=1.0)
    with pytest.raises(ValidationError, match="max_short_prompt_tokens"):
        LocalPrefillConfig(max_short_prompt_tokens=-1)
    with pytest.raises(ValidationError, match="max_short_tokens"):
        DispatcherConfig(local_prefill={"max_short_tokens": 10})


def test_prompts_sent_since_a_report_are_counted_within_the_bound_and_dropped_once_reported():
    from router.policy import SentSinceReport

    now = [0.0]
    sent = SentSinceReport(clock=lambda: now[0])
    sent.MAX_PER_WORKER = 3  # a silent worker's: the oldest go first
    for i in range(5):
        now[0] = float(i)
        sent.add("w", 10 + i)
    assert sent.queued_tokens(WorkerLoad("w", num_queued_prompt_tokens=100)) == 100 + 12 + 13 + 14
    assert sent.queued_tokens(WorkerLoad("w", num_queued_prompt_tokens=7, fetched_at=3.5)) == 7 + 14
    sent.forget("w")
    assert sent.queued_tokens(WorkerLoad("w", num_queued_prompt_tokens=7)) == 7
