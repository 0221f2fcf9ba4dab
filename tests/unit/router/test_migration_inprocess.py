"""Faults in one process, without Ray: two prefill and two decode workers over the fault transport
(wrapping local). A decode worker killed mid-stream (with prompts pushed by a prefill worker, or
prefilled on the decode worker itself), a prefill worker killed mid-prefill, a colocated worker
killed mid-stream, and each transfer fault (drop, delay past the deadline, fail): every greedy
or seeded stream still gives exactly the offline tokens, and no live worker holds a block afterwards.
With no capacity left, or faults on every attempt, requests end with a clear error, not a hang; a test whose loop
hangs anyway ends after 240 s with every task's stack (tests/watched.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from kvtransfer.fault import FaultRule
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, NoCapacityError, RequestFailedError, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig
from tests.watched import run_watched

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TRANSFER_TIMEOUT_S = 1.0
# NOTE: every prompt through a prefill worker (these prompts are short): the faults are the KV push's.
FAST = DispatcherConfig(max_capacity_wait_s=0.5, call_timeout_s=5.0, stall_timeout_s=20.0, prefill_timeout_s=30.0,
                        local_prefill=LocalPrefillConfig(rule="remote"))


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


class Killable:
    """A worker as the router sees it, that can die: after `kill` every call, including those under
    way, raises ConnectionError (as a Ray actor call does), its engine stops and its pairs break."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id
        self.is_killed = False
        self._dead = asyncio.Event()

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.worker, name)

        async def call(*args: Any) -> Any:
            if self.is_killed:
                raise ConnectionError(f"worker {self.worker_id} is dead")
            task = asyncio.ensure_future(method(*args))
            dead = asyncio.ensure_future(self._dead.wait())
            try:
                await asyncio.wait({task, dead}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                dead.cancel()
            if not task.done():
                task.cancel()  # what the dead worker was doing ends with it, whatever it raises
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                raise ConnectionError(f"worker {self.worker_id} died during {name}")
            return task.result()

        return call

    async def kill(self) -> None:
        self.is_killed = True
        self._dead.set()
        await self.worker.shutdown()  # stops the engine, closes the transport: its pairs break


class Cluster:
    def __init__(
        self, num_prefill: int = 2, num_decode: int = 2, colocated: bool = False, dispatch: DispatcherConfig = FAST,
        **engine_options: Any,
    ) -> None:
        hub = LocalHub()
        options = {"inner": "local", "inner_options": {"hub": hub}}
        engine = engine_config(**ENGINE, **engine_options)
        kind = "c" if colocated else "d"
        self.decode = {
            f"{kind}{i}": Killable(DecodeWorker(
                DecodeWorkerConfig(worker_id=f"{kind}{i}", engine=engine, transport="fault",
                                   transfer_timeout_s=TRANSFER_TIMEOUT_S, lease_ttl_s=10.0, pair_timeout_s=5.0),
                transport_options=options,
            )) for i in range(num_decode)
        }
        self.prefill = {} if colocated else {
            f"p{i}": Killable(PrefillWorker(
                PrefillWorkerConfig(worker_id=f"p{i}", engine=engine, transport="fault",
                                    transfer_timeout_s=TRANSFER_TIMEOUT_S, pair_timeout_s=5.0),
                transport_options=options,
            )) for i in range(num_prefill)
        }
        self.dispatcher = Dispatcher("r0", self.workers(), poll_timeout_s=0.2, config=dispatch)

    def workers(self) -> Workers:
        return Workers.of(prefill=dict(self.prefill), decode=dict(self.decode))

    def busiest_decode(self) -> Killable:
        """The decode worker streaming the most requests now: killing it moves at least one (the policy may
        place every request on one worker)."""
        streaming = self.dispatcher.num_streaming()
        return max(self.decode.values(), key=lambda w: streaming.get(w.worker_id, 0))

    def live(self) -> list[Killable]:
        return [w for w in (*self.prefill.values(), *self.decode.values()) if not w.is_killed]

    async def held(self) -> dict[str, int]:
        """Every live worker's held blocks once drained (leases of failed transfers included)."""
        await asyncio.sleep(0.3)
        return {w.worker_id: await w.check_integrity() for w in self.live()}

    async def close(self) -> None:
        await self.dispatcher.close()
        for w in self.live():
            await w.shutdown()


class Streams:
    """Runs requests concurrently, recording each one's tokens as they stream."""

    def __init__(self, dispatcher: Dispatcher, prompts: list[list[int]], params: SamplingParams) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.tasks = [asyncio.ensure_future(self._one(dispatcher, i, p, params)) for i, p in enumerate(prompts)]

    async def _one(self, dispatcher: Dispatcher, i: int, prompt: list[int], params: SamplingParams) -> list[int]:
        async for out in dispatcher.generate(f"req-{i}", prompt, params):
            self.tokens[i] += out.new_token_ids
        return self.tokens[i]

    async def until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        async def wait() -> None:
            while not condition():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(wait(), timeout_s)

    async def results(self, timeout_s: float = 120.0) -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), timeout_s)


def _offline(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]


@pytest.mark.parametrize("prefilled_locally", [False, True], ids=["pushed", "prefilled-locally"])
def test_a_killed_decode_worker_s_requests_move_on_with_exactly_the_offline_tokens(prefilled_locally):
    """Prompts pushed by a prefill worker, or (3 to 39 tokens, seed 4) all prefilled on their decode worker."""
    prompts = _prompts(8, seed=4 if prefilled_locally else 1)
    expected = _offline(prompts, GREEDY)
    dispatch = FAST.model_copy(update={"local_prefill": LocalPrefillConfig(max_short_prompt_tokens=40)})

    async def main():
        cluster = Cluster(dispatch=dispatch) if prefilled_locally else Cluster()
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        await streams.until(lambda: all(len(t) >= 3 for t in streams.tokens))
        if prefilled_locally:
            assert cluster.dispatcher.num_local_prefills == len(prompts)
        await cluster.busiest_decode().kill()
        results = await streams.results()
        assert results == expected
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_a_killed_prefill_worker_s_requests_are_retried_on_the_other():
    prompts = _prompts(8, seed=5)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster()
        p0 = cluster.prefill["p0"]
        # p0's pushes are held back, so that its requests are still under way when it dies
        await p0.arm_fault(FaultRule(action="delay", op="send", delay_s=30.0).encode())
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        await streams.until(lambda: (p0.worker.transport.stats().num_fired or {}).get("delay", 0) >= 1)
        await p0.kill()
        assert await streams.results() == expected
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_a_killed_colocated_worker_s_requests_are_resubmitted_with_their_tokens():
    prompts = _prompts(6)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster(num_decode=2, colocated=True)
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        await streams.until(lambda: all(len(t) >= 2 for t in streams.tokens))
        await cluster.busiest_decode().kill()
        assert await streams.results() == expected
        assert cluster.dispatcher.num_migrations >= 1  # its streams moved, tokens and all
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


@pytest.mark.parametrize(
    "rule",
    [
        FaultRule(action="drop", op="send", nth=2),
        FaultRule(action="delay", op="send", nth=1, delay_s=3 * TRANSFER_TIMEOUT_S),
        FaultRule(action="fail", op="send", probability=0.5, max_fires=3),
        FaultRule(action="drop", op="recv", nth=3),
        FaultRule(action="kill", op="recv", nth=1),
    ],
    ids=["drop-send", "delay-send", "fail-send", "drop-recv", "kill-recv"],
)
def test_transfer_faults_free_the_lease_retry_and_the_pairs_form_again(rule: FaultRule):
    prompts = _prompts(8, seed=2)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster()
        armed = cluster.prefill if rule.op == "send" else cluster.decode
        for worker in armed.values():
            await worker.arm_fault(rule.encode())
        results = await Streams(cluster.dispatcher, prompts, GREEDY).results()
        assert results == expected
        fired = [sum((await w.fault_stats())["num_fired"].values()) for w in armed.values()]
        assert sum(fired) >= 1
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        # the pairs form again: a request after the faults moves its KV normally
        assert await Streams(cluster.dispatcher, prompts[:2], GREEDY).results() == expected[:2]
        await cluster.close()

    run_watched(main())


def test_a_request_whose_kv_never_came_tries_another_prefill_worker_next():
    """Every push of p0 fails (a broken path out of it). A request's retry went back to the prefill worker that
    computed its prompt (its prefix cache), so one placed on p0 failed every attempt while p1 was healthy (the
    chaos test's drop fault under CPU load: 8 of 32 requests, 4 attempts each). Now the prefill worker of an
    attempt whose KV never reached its decode worker is avoided by the next attempt."""
    prompts = _prompts(8, seed=5)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster()
        await cluster.prefill["p0"].arm_fault(FaultRule(action="fail", op="send", max_fires=None).encode())
        results = await Streams(cluster.dispatcher, prompts, GREEDY).results()
        assert results == expected
        assert sum((await cluster.prefill["p0"].fault_stats())["num_fired"].values()) >= 1
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_pairs_form_while_the_default_thread_pool_is_busy():
    """Pairings block a thread each (up to pair_timeout_s) on both sides: on threads of their own they never
    wait behind the event loop's default pool, which grammar compiles also use (a chaos run under CPU load
    saw pushes stall past the lease TTL). Here that pool's only thread is held for the whole run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    prompts = _prompts(4, seed=6)
    expected = _offline(prompts, GREEDY)

    async def main():
        pool, held = ThreadPoolExecutor(1), threading.Event()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(pool)
        blocker = loop.run_in_executor(None, held.wait, 60.0)
        cluster = Cluster()
        try:
            results = await Streams(cluster.dispatcher, prompts, GREEDY).results(timeout_s=60.0)
            assert results == expected
            assert set((await cluster.held()).values()) == {0}
        finally:
            held.set()
            await blocker
            await cluster.close()

    run_watched(main())


def test_requests_are_prefilled_on_a_decode_worker_while_no_prefill_worker_serves():
    """The only prefill worker dies before the requests come: each first attempt's prefill call fails (the worker
    then sits out failed_worker_cooldown_s), and the retry, finding no prefill worker within max_capacity_wait_s,
    has a decode worker compute its prompt: the offline tokens, not NoCapacityError (as a chaos or role-flip run
    under load would lose them)."""
    prompts = _prompts(4, seed=8)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster(num_prefill=1, num_decode=2)
        await cluster.prefill["p0"].kill()
        results = await Streams(cluster.dispatcher, prompts, GREEDY).results(timeout_s=60.0)
        assert results == expected
        assert cluster.dispatcher.num_local_prefills == len(prompts)
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_no_capacity_left_ends_requests_with_a_clear_error_never_a_hang():
    prompts = _prompts(4)

    async def main():
        cluster = Cluster(num_prefill=1, num_decode=1)
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        await streams.until(lambda: all(len(t) >= 2 for t in streams.tokens))
        await cluster.decode["d0"].kill()
        results = await streams.results(timeout_s=30.0)
        assert all(isinstance(r, (NoCapacityError, RequestFailedError)) for r in results), results
        assert "no decode worker" in str(results[0])
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_a_fault_on_every_attempt_gives_up_after_max_attempts():
    async def main():
        cluster = Cluster(num_prefill=1, num_decode=1)
        await cluster.prefill["p0"].arm_fault(FaultRule(action="fail", op="send", max_fires=None).encode())
        (result,) = await Streams(cluster.dispatcher, _prompts(1), GREEDY).results(timeout_s=30.0)
        assert isinstance(result, RequestFailedError)
        # Each attempt is answered with its first token, then its push fails: the decode worker's receive
        # reports it (the one path a push's failure takes), and each failed send drops the pair.
        assert f"failed {FAST.max_attempts} times" in str(result) and "KV transfer failed" in str(result)
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


@pytest.mark.parametrize("colocated", [False, True], ids=["disaggregated", "colocated"])
def test_a_seeded_sampled_request_moves_on_with_exactly_the_offline_tokens(colocated):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    prompts = _prompts(4, seed=3)
    expected = _offline(prompts, params)

    async def main():
        cluster = Cluster(colocated=colocated)
        streams = Streams(cluster.dispatcher, prompts, params)
        await streams.until(lambda: all(len(t) >= 4 for t in streams.tokens))
        await cluster.busiest_decode().kill()
        # the same seed gives the same tokens, also across the move: draws are keyed by output position
        assert await streams.results() == expected
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


def test_a_pair_the_decode_side_lost_forms_again_from_the_prefill_side():
    """The decode worker dropped its pair with a prefill worker that still holds its own (a failed
    transfer's drop landed after the prefill side had moved on): the refusal says so
    (KvAcceptMsg.is_unpaired), the prefill side drops its half, and the retry forms the pair again.
    Before, every retry met the same refusal and the request failed after max_attempts."""
    prompts = _prompts(3, seed=5)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster(num_prefill=1, num_decode=1)
        assert await Streams(cluster.dispatcher, prompts[:1], GREEDY).results() == expected[:1]  # the pair forms
        decode, prefill = cluster.decode["d0"].worker, cluster.prefill["p0"].worker
        assert decode.transport.is_paired("p0") and prefill.transport.is_paired("d0")
        decode.transport.drop("p0")  # the decode side alone loses it
        migrations = cluster.dispatcher.num_migrations
        assert await Streams(cluster.dispatcher, prompts[1:], GREEDY).results() == expected[1:]
        assert cluster.dispatcher.num_migrations - migrations <= 2  # a refused attempt or two, not max_attempts
        assert decode.transport.is_paired("p0") and prefill.transport.is_paired("d0")
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    run_watched(main())


class _Mute:
    """A worker that takes requests and computes them, but whose polls never carry their tokens."""

    def __init__(self, worker: Killable) -> None:
        self.inner, self.worker_id = worker, worker.worker_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def poll(self, router_id: str, timeout_s: float = 1.0) -> bytes:
        from protocol.messages import TokenBatchMsg

        await asyncio.sleep(timeout_s)
        return TokenBatchMsg(worker_id=self.worker_id, outputs=[]).encode()


def test_a_worker_that_goes_quiet_has_its_requests_moved_after_stall_timeout():
    """stall_timeout_s: an attempt whose worker sends nothing for that long moves to another worker
    and the request still gives the offline tokens."""
    prompts = _prompts(2, seed=4)
    want = _offline(prompts, GREEDY)

    async def main() -> None:
        quick = FAST.model_copy(update={"stall_timeout_s": 0.6, "failed_worker_cooldown_s": 0.0})
        cluster = Cluster(num_decode=2, colocated=True, dispatch=quick)
        mute_id = "c0"
        mute = _Mute(cluster.decode[mute_id])
        cluster.dispatcher.set_workers(Workers.of(prefill={}, decode={**cluster.decode, mute_id: mute}))
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        results = await streams.results(timeout_s=60.0)
        assert results == want
        assert cluster.dispatcher.num_migrations >= 1  # at least one request started on the mute worker
        await cluster.dispatcher.close()
        assert all(n == 0 for n in (await cluster.held()).values())
        await cluster.close()

    run_watched(main())
