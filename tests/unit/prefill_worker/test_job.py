"""One request through every PrefillJob transition (prefill_worker/job.py), in one process without
Ray, over the fault transport wrapping the local one.

A small router stands in for the Dispatcher so that what it hears can be counted: it reserves a
lease, makes the one prefill call, and polls the decode worker's token stream. Its outcomes for a
request are the terminal things it hears: a prefill answer that ends the request (an error, a
finish, "aborted"), a row of the decode worker's stream that finishes or fails it, the decode
worker's death (its poll fails), or its own abort (a client that left). Each scenario asserts
exactly one outcome, the job's path through the states, and no block held on either worker (a
dead decode worker's blocks went with it: only the prefill worker is checked there)."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from kvtransfer.fault import FaultRule
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from prefill_worker.job import IllegalTransitionError, JobState, PrefillJob
from protocol.messages import (
    GenerateRequestMsg,
    LeaseMsg,
    PrefillResultMsg,
    PrefillTaskMsg,
    ReserveMsg,
    TokenBatchMsg,
)

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TRANSFER_TIMEOUT_S = 1.0
Q, C, A, P = JobState.QUEUED, JobState.COMPUTING, JobState.ANSWERED, JobState.PUSHING


def _prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2048) for _ in range(40)]


class _Scene:
    """A prefill and a decode worker, a stand-in router ("r0"), and the ended jobs' paths."""

    def __init__(self, lease_ttl_s: float = 30.0) -> None:
        options = {"inner": "local", "inner_options": {"hub": LocalHub()}}
        engine = engine_config(**ENGINE)
        self.decode = DecodeWorker(DecodeWorkerConfig(
            worker_id="d0", engine=engine, transport="fault", transfer_timeout_s=TRANSFER_TIMEOUT_S,
            lease_ttl_s=lease_ttl_s), transport_options=options)
        self.prefill = PrefillWorker(PrefillWorkerConfig(
            worker_id="p0", engine=engine, transport="fault", transfer_timeout_s=TRANSFER_TIMEOUT_S,
            pair_timeout_s=5.0), transport_options=options)
        self.paths: dict[str, list[JobState]] = {}  # request -> the states its job went through
        end = self.prefill._end

        def recording(job: PrefillJob) -> None:
            self.paths[job.request_id] = [*job.history, job.state]
            end(job)

        self.prefill._end = recording  # type: ignore[method-assign]
        self.outcomes: list[str] = []
        self.is_decode_dead = False
        self.step_gate = threading.Event()  # the prefill worker's engine steps only while it is set
        self.step_gate.set()
        step = self.prefill.loop.engine.step

        def gated_step() -> Any:
            self.step_gate.wait(30)
            return step()

        self.prefill.loop.engine.step = gated_step  # type: ignore[method-assign]

    async def start(self, rid: str, params: SamplingParams = GREEDY) -> asyncio.Task[bytes]:
        """The router's flow: a lease, then the one prefill call (answered in the returned task)."""
        prompt = _prompt()
        lease = await self.decode.reserve(ReserveMsg(request_id=rid, num_prompt_tokens=len(prompt),
                                                     router_id="r0").encode())
        assert lease is not None
        request = GenerateRequestMsg(request_id=rid, prompt_token_ids=prompt, params=params, router_id="r0")
        task = PrefillTaskMsg(request=request, lease=LeaseMsg.decode(lease)).encode()
        call = asyncio.ensure_future(self.prefill.prefill(task, self.decode))
        await asyncio.sleep(0.05)  # NOTE: the job exists, and has gone as far as the gates let it
        return call

    def state(self, rid: str) -> JobState:
        return self.prefill.jobs[rid].state

    async def answer(self, call: asyncio.Task[bytes]) -> PrefillResultMsg:
        answer = PrefillResultMsg.decode(await asyncio.wait_for(call, 10))
        if answer.error is not None or answer.finish_reason is not None:
            self.outcomes.append(f"answer: {answer.finish_reason or ''} {answer.error or ''}".strip())
        return answer

    async def stream(self, rid: str, timeout_s: float = 5.0) -> list[int]:
        """The decode worker's rows for the request until one ends it (its outcome), the worker dies,
        or `timeout_s` of nothing more."""
        tokens: list[int] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.is_decode_dead:
                self.outcomes.append("decode worker lost")
                return tokens
            batch = TokenBatchMsg.decode(await self.decode.poll("r0", 0.1))
            for row in batch.outputs:
                if row.request_id != rid:
                    continue
                tokens += row.new_token_ids
                if row.error is not None or row.finish_reason is not None:
                    self.outcomes.append(f"stream: {row.finish_reason} {row.error or ''}".strip())
                    return tokens
        return tokens

    async def client_leaves(self, rid: str) -> None:
        """What the Dispatcher does when the client goes: abort on both workers."""
        self.outcomes.append("aborted by the router")
        await asyncio.gather(self.prefill.abort(rid), self.decode.abort(rid))

    def kill_decode(self) -> None:
        """The decode worker dies: every call to it fails, and so does its end of the pair."""
        self.is_decode_dead = True

        async def dead(*_: Any, **__: Any) -> Any:
            raise ConnectionError("decode worker d0 died")

        for name in ("kv_incoming", "transport_address", "accept_pair", "poll", "abort", "reserve"):
            setattr(self.decode, name, dead)
        self.decode.transport.drop("p0")

    async def held(self) -> list[int]:
        workers = [self.prefill] if self.is_decode_dead else [self.prefill, self.decode]
        return [await w.check_integrity() for w in workers]

    async def close(self) -> None:
        self.step_gate.set()
        await self.prefill.shutdown()
        await self.decode.shutdown()


def _run(scenario) -> None:
    async def main() -> None:
        scene = _Scene(**getattr(scenario, "scene", {}))
        try:
            await asyncio.wait_for(scenario(scene), 30)
            assert len(scene.outcomes) == 1, scene.outcomes
            assert await scene.held() == [0] * (1 if scene.is_decode_dead else 2)
        finally:
            await scene.close()

    asyncio.run(main())


def test_done_after_the_push():
    async def scenario(s: _Scene) -> None:
        answer = await s.answer(await s.start("r"))
        assert answer.first_token is not None and answer.push_bytes > 0
        tokens = await s.stream("r")
        assert [answer.first_token, *tokens] == LLM(**ENGINE).generate([_prompt()], GREEDY)[0].outputs[0].token_ids
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, P, JobState.DONE]
        assert s.outcomes == ["stream: length"]

    _run(scenario)


def test_done_at_the_answer_when_the_first_token_ends_the_request():
    async def scenario(s: _Scene) -> None:
        answer = await s.answer(await s.start("r", SamplingParams(max_tokens=1, temperature=0.0)))
        assert answer.finish_reason == "length" and answer.push_bytes == 0
        assert s.paths["r"] == [Q, C, A, JobState.DONE]
        await s.decode.abort("r")  # the router frees the lease it no longer needs

    _run(scenario)


def test_abort_while_queued():
    async def scenario(s: _Scene) -> None:
        gate = threading.Event()
        s.prefill.loop.submit(lambda e: gate.wait(10))  # the engine thread is busy: the prompt waits
        call = await s.start("r")
        assert s.state("r") is Q
        aborting = asyncio.ensure_future(s.client_leaves("r"))
        await asyncio.sleep(0.05)
        gate.set()
        await aborting
        answer = PrefillResultMsg.decode(await call)
        assert answer.finish_reason == "abort"
        assert s.paths["r"] == [Q, JobState.ABORTED]

    _run(scenario)


def test_abort_while_computing():
    async def scenario(s: _Scene) -> None:
        s.step_gate.clear()
        call = await s.start("r")
        assert s.state("r") is C
        aborting = asyncio.ensure_future(s.client_leaves("r"))
        await asyncio.sleep(0.05)
        s.step_gate.set()
        await aborting
        assert PrefillResultMsg.decode(await call).finish_reason == "abort"
        assert s.paths["r"] == [Q, C, JobState.ABORTED]

    _run(scenario)


def test_abort_when_answered_before_the_push_starts():
    async def scenario(s: _Scene) -> None:
        gate = asyncio.Event()  # the handshake waits here
        kv_incoming = s.decode.kv_incoming

        async def held(ready: bytes) -> bytes:
            await gate.wait()
            return await kv_incoming(ready)

        s.decode.kv_incoming = held  # type: ignore[method-assign]
        answer = PrefillResultMsg.decode(await (await s.start("r")))
        assert answer.first_token is not None and s.state("r") is A
        await s.client_leaves("r")
        gate.set()
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, JobState.ABORTED]
        assert await s.stream("r", timeout_s=0.5) == []  # the refused handshake of an aborted lease says nothing
        assert (s.prefill.push_log.totals.num_cancelled, s.prefill.push_log.totals.num_failed) == (1, 0)

    _run(scenario)


def test_abort_while_pushing():
    async def scenario(s: _Scene) -> None:
        await s.prefill.arm_fault(FaultRule(action="delay", op="send", delay_s=0.5).encode())
        answer = PrefillResultMsg.decode(await (await s.start("r")))
        for _ in range(100):  # bounded: the handshake is accepted, the send under way
            if s.state("r") is P:
                break
            await asyncio.sleep(0.01)
        assert s.state("r") is P and answer.first_token is not None
        await s.client_leaves("r")
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, P, JobState.ABORTED]
        assert await s.stream("r", timeout_s=1.0) == []
        totals = s.prefill.push_log.totals  # a client that left is a cancellation, not a failure
        assert (totals.num_cancelled, totals.num_failed, totals.num_pushed) == (1, 0, 0)

    _run(scenario)


def test_the_push_fails():
    async def scenario(s: _Scene) -> None:
        await s.prefill.arm_fault(FaultRule(action="fail", op="send").encode())
        answer = await s.answer(await s.start("r"))
        assert answer.first_token is not None
        assert await s.stream("r") == []
        assert "KV transfer failed" in s.outcomes[0]
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, P, JobState.FAILED]
        assert (s.prefill.push_log.totals.num_failed, s.prefill.push_log.totals.num_cancelled) == (1, 0)

    _run(scenario)


def test_the_pair_cannot_form():
    """A push that cannot start (here pairing fails; a layout mismatch does the same) is told to the
    decode worker, which frees the lease and tells the router."""
    async def scenario(s: _Scene) -> None:
        async def refuse(*_: Any) -> None:
            raise RuntimeError("no pair today")

        s.decode.accept_pair = refuse  # type: ignore[method-assign]
        answer = await s.answer(await s.start("r"))
        assert answer.first_token is not None
        assert await s.stream("r") == []
        assert "no pair today" in s.outcomes[0]
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, JobState.FAILED]

    _run(scenario)


def test_the_lease_expires_before_the_push():
    async def scenario(s: _Scene) -> None:
        s.step_gate.clear()  # the prompt takes longer than the lease lives
        call = await s.start("r")
        assert await s.stream("r", timeout_s=3.0) == []
        assert "expired" in s.outcomes[0]
        s.step_gate.set()
        answer = await s.answer(call)
        assert answer.first_token is not None
        await s.prefill.settle_pushes()
        assert s.paths["r"] == [Q, C, A, JobState.FAILED]  # the handshake was refused: the lease is gone
        assert await s.stream("r", timeout_s=0.5) == [] and len(s.outcomes) == 1

    scenario.scene = {"lease_ttl_s": 0.5}
    _run(scenario)


@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_the_decode_worker_dies(when):
    async def scenario(s: _Scene) -> None:
        if when == "during":
            await s.prefill.arm_fault(FaultRule(action="drop", op="send").encode())  # the send never ends
        s.step_gate.clear()
        call = await s.start("r")
        if when == "before":
            s.kill_decode()
        s.step_gate.set()
        answer = await s.answer(call)
        assert answer.first_token is not None
        if when == "during":
            for _ in range(100):  # bounded
                if s.state("r") is P:
                    break
                await asyncio.sleep(0.01)
            assert s.state("r") is P
            s.kill_decode()
        if when == "after":
            await s.prefill.settle_pushes()
            await asyncio.sleep(0.1)  # its first step
            s.kill_decode()
        await s.stream("r")
        assert await s.prefill.settle_pushes() == 0  # NOTE: the push that never ends fails by its own timeout
        assert s.outcomes == ["decode worker lost"]
        want = {"before": [Q, C, A, JobState.FAILED], "during": [Q, C, A, P, JobState.FAILED],
                "after": [Q, C, A, P, JobState.DONE]}[when]
        assert s.paths["r"] == want

    _run(scenario)


def test_only_the_transitions_of_the_table_are_allowed():
    ended: list[JobState] = []
    task = PrefillTaskMsg(
        request=GenerateRequestMsg(request_id="r", prompt_token_ids=[1, 2], params=GREEDY, router_id="r0"),
        lease=LeaseMsg(lease_id="l", decode_worker_id="d0", block_ids=[0], expires_at=0.0),
    )

    def job() -> PrefillJob:
        loop = asyncio.new_event_loop()
        try:
            return PrefillJob(task, None, loop.create_future(), lambda j: ended.append(j.state))
        finally:
            loop.close()

    j = job()
    with pytest.raises(IllegalTransitionError, match="queued -> answered"):
        j.move(A)
    j.move(C)
    j.move(A)
    with pytest.raises(IllegalTransitionError, match="answered -> computing"):
        j.move(C)
    assert j.abort()
    j.move(P)  # an accepted handshake still sends
    j.move(JobState.DONE)  # an abort wins: it ends ABORTED
    assert j.state is JobState.ABORTED and ended == [JobState.ABORTED]
    assert not j.abort()
    with pytest.raises(IllegalTransitionError):
        j.move(JobState.FAILED)  # final
    assert ended == [JobState.ABORTED]  # on_end ran once
