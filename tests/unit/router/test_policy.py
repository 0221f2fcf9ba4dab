"""Dispatch policies: cache-aware prefill choice, load-aware decode choice, round robin, registry."""

from __future__ import annotations

import asyncio

import pytest

from router.policy import CacheAwarePolicy, LoadTracker, PrefixIndex, WorkerLoad, create_policy


def test_prefill_goes_where_the_prefix_was_sent():
    policy = CacheAwarePolicy(block_size=4)
    shared = list(range(100, 140))
    policy.on_assigned("p1", shared + [1, 2, 3])
    assert policy.prefill_order(shared + [9, 9, 9, 9], ["p0", "p1", "p2"])[0] == "p1"
    # no cached prefix anywhere: the shortest queue wins
    policy.loads = {"p0": WorkerLoad("p0", num_waiting=5), "p1": WorkerLoad("p1", num_waiting=9),
                    "p2": WorkerLoad("p2", num_waiting=1)}
    assert policy.prefill_order(list(range(500, 540)), ["p0", "p1", "p2"])[0] == "p2"


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


def test_ties_rotate_and_round_robin():
    policy = CacheAwarePolicy()
    firsts = {policy.decode_order(1, ["a", "b", "c"])[0] for _ in range(3)}
    assert firsts == {"a", "b", "c"}
    rr = create_policy("round_robin")
    assert [rr.decode_order(1, ["a", "b"])[0] for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="unknown; known: cache_aware, round_robin"):
        create_policy("random")


def test_prefix_index_is_bounded_lru():
    index = PrefixIndex(block_size=2, max_blocks=3)
    index.add("w", index.hashes([1, 2, 3, 4, 5, 6]))
    assert index.match_blocks("w", index.hashes([1, 2, 3, 4, 9, 9])) == 2
    index.add("w", index.hashes([7, 8]))  # evicts the oldest block ([1, 2])
    assert index.match_blocks("w", index.hashes([1, 2, 3, 4])) == 0
    index.forget("w")
    assert index.match_blocks("w", index.hashes([7, 8])) == 0


def test_load_tracker_refreshes_and_drops_gone_workers():
    async def main():
        calls = []

        async def fetch(worker_id):
            calls.append(worker_id)
            if worker_id == "dead":
                raise RuntimeError("gone")
            return {"num_running": 2, "num_waiting": 1, "num_free_blocks": 7, "num_blocks": 9}

        tracker = LoadTracker(fetch, interval_s=0.01)
        tracker.track(["a", "dead"])
        await asyncio.sleep(0.1)
        assert tracker.loads["a"] == WorkerLoad("a", 2, 1, 7, 9) and "dead" not in tracker.loads
        tracker.track(["b"])
        await asyncio.sleep(0.1)
        assert set(tracker.loads) == {"b"}
        tracker.close()

    asyncio.run(main())
