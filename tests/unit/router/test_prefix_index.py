"""router.prefix_index: what a router believes each worker's prefix cache holds. Its predictions (prompts
it sent) are bounded; the workers' journals, mirrored by CacheMirror, make it exact up to the last read,
whatever another router replica sent and whatever a worker evicted. Two routers in one process over the
same workers (no Ray), two colocated ones, or two prefill workers and a decode worker: the second router
sends every prompt the first warmed to the worker that holds it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.cache_events import REMOVED, STORED
from engine.llm import engine_config
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from protocol.api import CacheDeltaMsg
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig
from router.prefix_index import CacheMirror, PrefixIndex


def _delta(hashes, kinds=None, snapshot=False, epoch="e", cursor=0, block_size=2) -> CacheDeltaMsg:
    kinds = bytes([STORED] * len(hashes)) if kinds is None else bytes(kinds)
    return CacheDeltaMsg(epoch=epoch, cursor=cursor, is_snapshot=snapshot, kinds=kinds, hashes=hashes,
                         block_size=block_size)


def test_predictions_are_a_bounded_lru():
    index = PrefixIndex(block_size=2, max_blocks=3)
    index.add("w", index.hashes([1, 2, 3, 4, 5, 6]))
    assert index.match_blocks("w", index.hashes([1, 2, 3, 4, 9, 9])) == 2
    index.add("w", index.hashes([7, 8]))  # evicts the oldest block ([1, 2])
    assert index.match_blocks("w", index.hashes([1, 2, 3, 4])) == 0
    index.forget("w")
    assert index.match_blocks("w", index.hashes([7, 8])) == 0


def test_a_worker_s_reports_add_replace_and_remove_what_the_router_believed():
    index = PrefixIndex(block_size=2)
    prompt = index.hashes([1, 2, 3, 4, 5, 6])
    index.apply("w", _delta(prompt[:2]))  # sent by another router replica: this one learns it
    assert index.match_blocks("w", prompt) == 2 and index.match_blocks("v", prompt) == 0
    index.add("w", prompt)  # this router sends the whole prompt: predicted
    assert index.match_blocks("w", prompt) == 3
    index.apply("w", _delta([prompt[0]], kinds=[REMOVED]))  # evicted there: no longer a match at all
    assert index.match_blocks("w", prompt) == 0
    index.apply("w", _delta([prompt[0], prompt[2]], kinds=[STORED, REMOVED]))  # the third block's prediction goes
    assert index.match_blocks("w", prompt) == 2
    index.apply("w", _delta([prompt[2]], snapshot=True))  # what it holds now, whole
    assert index.match_blocks("w", prompt) == 0 and index.match_blocks("w", prompt[2:]) == 1
    assert index.longest_matches([1, 2, 3, 4, 5, 6], ["w", "v"]) == {"w": 0, "v": 0}


def test_workers_of_another_block_size_make_the_index_start_over_in_theirs():
    index = PrefixIndex(block_size=2)
    index.add("w", index.hashes([1, 2, 3, 4]))
    other = PrefixIndex(block_size=4)
    index.apply("v", _delta(other.hashes([1, 2, 3, 4]), block_size=4))
    assert index.block_size == 4
    assert index.match_blocks("v", index.hashes([1, 2, 3, 4, 5])) == 1
    assert index.match_blocks("w", index.hashes([1, 2, 3, 4])) == 0  # predictions in the old size are gone


def test_longest_matches_hashes_only_while_some_worker_matches(monkeypatch):
    from router import prefix_index

    calls = []
    real = prefix_index.hash_block
    monkeypatch.setattr(prefix_index, "hash_block", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    index = PrefixIndex(block_size=2)
    index.add("a", index.hashes([1, 2, 3, 4, 5, 6]))
    index.apply("b", _delta(index.hashes([1, 2, 7, 8])))
    calls.clear()
    assert index.longest_matches([1, 2, 3, 4, 9, 9, 9, 9, 9, 9], ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}
    assert len(calls) == 3  # [1, 2] [3, 4] [9, 9], then no worker matches
    calls.clear()
    assert index.longest_matches(list(range(50, 90)), ["a", "b"]) == {"a": 0, "b": 0}
    assert len(calls) == 1


def test_the_mirror_reads_from_each_worker_s_cursor_and_forgets_workers_gone():
    async def main():
        asked = []
        index = PrefixIndex(block_size=2)
        hashes = index.hashes([1, 2, 3, 4])

        async def fetch(worker_id, epoch, cursor):
            asked.append((worker_id, epoch, cursor))
            if worker_id == "dead":
                raise RuntimeError("gone")
            return _delta(hashes, epoch="e1", cursor=cursor + 10, snapshot=cursor < 0)

        mirror = CacheMirror(index, fetch, interval_s=0.01)
        mirror.track(["a", "dead"])
        for _ in range(500):  # NOTE: polled, at most 5 s
            if ("a", "e1", 9) in asked:
                break
            await asyncio.sleep(0.01)
        assert asked[:2] == [("a", "", -1), ("dead", "", -1)] and ("a", "e1", 9) in asked
        assert index.match_blocks("a", hashes) == 2
        mirror.track(["b"])
        assert index.match_blocks("a", hashes) == 0
        mirror.close()

    asyncio.run(main())


def _worker(worker_id: str, hub: LocalHub | None = None) -> DecodeWorker:
    engine = engine_config(device="cpu", block_size=8, num_blocks=256)
    return DecodeWorker(DecodeWorkerConfig(worker_id=worker_id, engine=engine, transport="local"),
                        transport_options={"hub": hub or LocalHub()})


def _prefill_worker(worker_id: str, hub: LocalHub) -> PrefillWorker:
    engine = engine_config(device="cpu", block_size=8, num_blocks=256)
    return PrefillWorker(PrefillWorkerConfig(worker_id=worker_id, engine=engine, transport="local"),
                         transport_options={"hub": hub})


async def _cached_tokens(dispatcher: Dispatcher, prompts: list[list[int]], tag: str) -> list[int]:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        cached = 0
        async for out in dispatcher.generate(f"{tag}-{i}", prompt, params):
            cached = max(cached, out.num_cached_tokens)
        return cached

    return list(await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 120))


async def _settled(dispatcher: Dispatcher, names: list[str], prompts: list[list[int]]) -> None:
    """Until the workers' loads were reported after now (the prompts this router sent count as queued till
    then, and could outweigh a cached prefix) and its index has a home for every prompt; polled, at most 5 s."""
    now = time.monotonic()
    index = dispatcher.prefix
    for _ in range(500):
        loads = dispatcher.loads.loads
        if all(w in loads and loads[w].fetched_at > now for w in names) and all(
                max(index.match_blocks(w, index.hashes(p)) for w in names) for p in prompts):
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_second_router_sends_prompts_where_the_first_router_s_left_them_cached(mode):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(24, 64))] for _ in range(12)]
    full_blocks = [len(p) // 8 * 8 - (8 if len(p) % 8 == 0 else 0) for p in prompts]  # a last token is computed
    # disaggregated: every prompt through one of two prefill workers (the prefill rule 'remote')
    local = LocalPrefillConfig(rule="remote" if mode == "disaggregated" else "short_or_cached")
    config = DispatcherConfig(load_refresh_s=0.02, local_prefill=local)

    async def main():
        hub = LocalHub()
        if mode == "colocated":
            holders = [_worker("d0"), _worker("d1")]
            workers_list = holders
            workers = Workers.of(prefill={}, decode={w.worker_id: w for w in holders})
        else:
            holders = [_prefill_worker("p0", hub), _prefill_worker("p1", hub)]
            workers_list = [*holders, _worker("d0", hub)]
            workers = Workers.of(prefill={w.worker_id: w for w in holders}, decode={"d0": workers_list[2]})
        names = [w.worker_id for w in holders]
        first, second = (Dispatcher(name, workers, poll_timeout_s=0.2, config=config, block_size=8)
                         for name in ("rA", "rB"))
        try:
            assert await _cached_tokens(first, prompts, "cold") == [0] * len(prompts)
            await _settled(first, names, prompts)
            assert await _cached_tokens(first, prompts, "again") == full_blocks  # the router that sent them
            await _cached_tokens(second, [[1, 2, 3]], "start")  # its mirror starts with its first request
            await _settled(second, names, prompts)
            assert await _cached_tokens(second, prompts, "other") == full_blocks
        finally:
            await first.close()
            await second.close()
        held = [await w.check_integrity() for w in workers_list]
        for w in workers_list:
            await w.shutdown()
        return held

    assert asyncio.run(main()) == [0] * (2 if mode == "colocated" else 3)
