"""PrefillWorkerConfig.answer_before_push, in one process without Ray (fault transport over local):
after an accepted early handshake, or with none once the lease is attached, the router has the
first token while the KV push is still under way (its sends held back by a delay fault), and the
push's figures come afterwards in the worker's push_records and stats; with the option off the
answer waits for the push. A push that fails after the answer, a handshake the decode worker
refuses after it, and a handshake that never comes (the lease expires) each reach the router from
the decode worker, and the request moves on with exactly the offline tokens. Nothing stays held on
either worker."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from kvtransfer.fault import FaultRule
from kvtransfer.protocol import PrefillResultMsg
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REMOTE = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"), stall_timeout_s=20.0)
DELAY_S = 1.0  # every KV send finishes this much later than it would


def _prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(20, 60))] for _ in range(count)]


def _build(answer_before_push: bool, num_prefill: int = 1, early_handshake: bool = True, lease_ttl_s: float = 30.0,
           pair_timeout_s: float = 60.0):
    hub = LocalHub()
    options = {"inner": "local", "inner_options": {"hub": hub}}
    engine = engine_config(**ENGINE)
    decode = DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine, transport="fault", transfer_timeout_s=3 * DELAY_S,
                           lease_ttl_s=lease_ttl_s),
        transport_options=options,
    )
    prefill = {
        f"p{i}": PrefillWorker(
            PrefillWorkerConfig(worker_id=f"p{i}", engine=engine, transport="fault", transfer_timeout_s=3 * DELAY_S,
                                answer_before_push=answer_before_push, early_handshake=early_handshake,
                                pair_timeout_s=pair_timeout_s),
            transport_options=options,
        ) for i in range(num_prefill)
    }
    return Workers(prefill=prefill, decode={"d0": decode}), [*prefill.values(), decode]


async def _first_token_and_rest(dispatcher: Dispatcher, rid: str, prompt: list[int], on_first) -> list[int]:
    tokens: list[int] = []
    async for out in dispatcher.generate(rid, prompt, GREEDY):
        if not tokens and out.new_token_ids:
            await on_first()
        tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize(("answer_before_push", "early_handshake"), [(True, True), (True, False), (False, True)],
                         ids=["before-push", "before-push-late-handshake", "after-push"])
def test_the_first_token_does_not_wait_for_a_slow_push(answer_before_push, early_handshake):
    prompt = _prompts(1)[0]
    offline = LLM(**ENGINE).generate([prompt], GREEDY)[0].outputs.token_ids

    async def main():
        workers, objs = _build(answer_before_push, early_handshake=early_handshake)
        prefill = workers.prefill["p0"]
        dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=REMOTE)
        answers: list[PrefillResultMsg] = []
        prefill_call = prefill.prefill

        async def recording(task: bytes, decode_worker=None) -> bytes:
            answer = await prefill_call(task, decode_worker)
            answers.append(PrefillResultMsg.decode(answer))
            return answer

        prefill.prefill = recording  # type: ignore[method-assign]
        warm = await _first_token_and_rest(dispatcher, "warm", _prompts(1, seed=9)[0], _nothing)  # pairs the two
        assert len(warm) == GREEDY.max_tokens
        await prefill.arm_fault(FaultRule(action="delay", op="send", delay_s=DELAY_S).encode())
        seen: dict[str, float] = {}

        async def on_first() -> None:
            seen["pushes_under_way"] = (await prefill.stats())["num_pushes_under_way"]
            seen["first_token_s"] = time.perf_counter() - start

        start = time.perf_counter()
        tokens = await asyncio.wait_for(_first_token_and_rest(dispatcher, "slow", prompt, on_first), 60)
        assert tokens == offline
        answer = answers[-1]
        assert answer.request_id == "slow" and answer.first_token == offline[0]
        if answer_before_push:
            # the router had the first token while the push (held DELAY_S) was still going
            assert answer.push_pending and seen["pushes_under_way"] == 1
            assert seen["first_token_s"] < DELAY_S
            assert answer.push_bytes > 0 and answer.push_s == 0.0
            assert await prefill.settle_pushes() == 0
            record = PrefillResultMsg.decode((await prefill.push_records())[-1])
            assert record.request_id == "slow" and record.push_bytes == answer.push_bytes
            assert record.push_s >= 0.9 * DELAY_S and record.error is None
            stats = await prefill.stats()
            # this one, and the warm-up's after an early handshake (which formed the pair beside its prefill;
            # without one, a request that has to form the pair is answered after it: pairing checks the layouts)
            assert stats["num_kv_pushes_after_answer"] == (2 if early_handshake else 1)
            assert stats["kv_push_bytes_after_answer"] >= answer.push_bytes
            assert stats["kv_push_seconds_after_answer"] >= 0.9 * DELAY_S
        else:
            assert not answer.push_pending and seen["pushes_under_way"] == 0
            assert seen["first_token_s"] >= DELAY_S and answer.push_s >= 0.9 * DELAY_S  # sends issued in the step
            assert await prefill.push_records() == []
        assert [await w.check_integrity() for w in objs] == [0, 0]
        await dispatcher.close()
        for w in objs:
            await w.shutdown()

    asyncio.run(main())


def test_a_push_that_fails_after_the_answer_moves_the_request_on_with_the_offline_tokens():
    prompts = _prompts(4, seed=7)
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def main():
        workers, objs = _build(answer_before_push=True, num_prefill=2)
        dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=REMOTE)
        for i, prefill in enumerate(workers.prefill.values()):
            await prefill.arm_fault(FaultRule(action="fail", op="send", nth=1 + i).encode())
        firsts: list[int] = []

        async def one(i: int) -> list[int]:
            async def on_first() -> None:
                firsts.append(i)

            return await _first_token_and_rest(dispatcher, f"r{i}", prompts[i], on_first)

        tokens = [await asyncio.wait_for(one(i), 60) for i in range(len(prompts))]  # one at a time
        assert tokens == offline
        failed = [(await p.stats())["num_kv_push_failures_after_answer"] for p in workers.prefill.values()]
        assert sum(failed) >= 1  # a push failed after its answer, and its request still gave the offline tokens
        assert dispatcher.num_migrations >= 1
        assert [await w.check_integrity() for w in objs] == [0, 0, 0]
        await dispatcher.close()
        for w in objs:
            await w.shutdown()

    asyncio.run(main())


async def _nothing() -> None:
    return None


@pytest.mark.parametrize("fault", ["refused", "never-comes"])
def test_a_late_handshake_that_fails_after_the_answer_moves_the_request_on(fault, caplog):
    """Without the early handshake the answer goes once the lease is attached (and the pair formed,
    here by a first request), before the decode worker has heard of the KV. Its KvReady is refused
    (the decode side lost the pair), or never comes (the call hangs; the lease expires): the decode
    worker tells the router, which moves the request on with its first token kept and gets exactly
    the offline tokens."""
    prompt = _prompts(1, seed=3)[0]
    offline = LLM(**ENGINE).generate([prompt], GREEDY)[0].outputs.token_ids

    async def main():
        # NOTE: the hung handshake times out (pair_timeout_s) before the next attempt's lease could expire
        workers, objs = _build(True, early_handshake=False, lease_ttl_s=1.0, pair_timeout_s=0.5)
        prefill, decode = workers.prefill["p0"], workers.decode["d0"]
        dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=REMOTE)
        answers: list[PrefillResultMsg] = []
        prefill_call, kv_incoming = prefill.prefill, decode.kv_incoming

        async def recording(task: bytes, decode_worker=None) -> bytes:
            answer = await prefill_call(task, decode_worker)
            answers.append(PrefillResultMsg.decode(answer))
            return answer

        calls = []

        async def failing_once(ready: bytes) -> bytes:
            calls.append(ready)
            if len(calls) == 1:
                if fault == "refused":
                    decode.transport.drop("p0")  # the decode side lost the pair: it refuses, and says so
                else:
                    await asyncio.sleep(3600)  # never answers (the prefill side times out at pair_timeout_s)
            return await kv_incoming(ready)

        warm = await _first_token_and_rest(dispatcher, "warm", _prompts(1, seed=9)[0], _nothing)  # pairs the two
        assert len(warm) == GREEDY.max_tokens
        prefill.prefill = recording  # type: ignore[method-assign]
        decode.kv_incoming = failing_once  # type: ignore[method-assign]
        tokens = await asyncio.wait_for(_first_token_and_rest(dispatcher, "late", prompt, _nothing), 60)
        assert tokens == offline
        assert answers[0].push_pending and answers[0].first_token == offline[0]  # answered before its push failed
        assert len(answers) == 2 and answers[1].request_id == "late#1"  # the continuation, through a prefill again
        assert dispatcher.num_migrations == 1
        # the router heard it from the decode worker (not from its stall watch, stall_timeout_s 20 s)
        said = {"refused": "worker d0: decode worker refused the KV: 'd0' is not paired with 'p0'",
                "never-comes": "worker d0: lease d0/1 expired: no KV came within lease_ttl_s"}[fault]
        assert any(said in r.getMessage() for r in caplog.records if r.name == "router.dispatch")
        assert await prefill.settle_pushes(5.0) == 0
        assert (await prefill.stats())["num_kv_push_failures_after_answer"] == 1
        assert [await w.check_integrity() for w in objs] == [0, 0]
        await dispatcher.close()
        for w in objs:
            await w.shutdown()

    asyncio.run(main())
