"""Prefill workers reached over the request channel (protocol/channel.py), in one process without
Ray: the Dispatcher holds only clients with channels, so every prefill and abort crosses
a real socket, and the decode worker a prefill names goes as a reference (here a registry's key:
in-process workers do not pickle). Greedy tokens equal the offline engine's; a prefill worker's
connection lost while prompts are on it moves them to another prefill worker with exact tokens;
no block is held on any worker after."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.channel import Call, ChannelClient, Refs
from protocol.clients import DecodeClient, PrefillClient
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from prefill_worker.job import JobState
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
REMOTE = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))  # every prompt through a prefill worker


class _RegistryRefs(Refs):
    """References to in-process workers: a key into one registry both ends share."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[bytes, Any] = {}

    def encode(self, handle: Any) -> bytes | None:
        if handle is None:
            return None
        key = str(id(handle)).encode()
        self.objects[key] = handle
        return key

    def decode(self, ref: bytes | None) -> Any:
        return None if ref is None else self.objects[ref]


def _offline(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


class _Cluster:
    """A decode worker and prefill workers in this process, each behind its own channel; records the
    calls each prefill worker's channel carried."""

    def __init__(self, num_prefill: int) -> None:
        hub = LocalHub()
        refs = _RegistryRefs()
        self.decode = DecodeWorker(DecodeWorkerConfig(worker_id="d0", engine=engine_config(**ENGINE),
                                                      transport="local"), transport_options={"hub": hub})
        self.prefill = [PrefillWorker(PrefillWorkerConfig(worker_id=f"p{i}", engine=engine_config(**ENGINE),
                                                          transport="local"), transport_options={"hub": hub})
                        for i in range(num_prefill)]
        self.calls: dict[str, list[Call]] = {}
        for p in self.prefill:
            p.refs = refs
            self.calls[p.worker_id] = self._record(p)
        everyone = [self.decode, *self.prefill]
        self.clients = [ChannelClient(w.worker_id, w.channel_address, 5.0) for w in everyone]
        channels = dict(zip([w.worker_id for w in everyone], self.clients))
        self.workers = Workers(
            prefill={p.worker_id: PrefillClient(p.worker_id, p, channels[p.worker_id], refs) for p in self.prefill},
            decode={"d0": DecodeClient("d0", self.decode, channels["d0"], refs)})

    @staticmethod
    def _record(worker: PrefillWorker) -> list[Call]:
        calls: list[Call] = []
        handlers = worker.channel.handlers
        for call, inner in list(handlers.items()):
            def recorded(*args: Any, _call: Call = call, _inner: Any = inner) -> Any:
                calls.append(_call)
                return _inner(*args)

            handlers[call] = recorded
        return calls

    async def close(self) -> None:
        for c in self.clients:
            c.close()
        workers = [self.decode, *self.prefill]
        try:
            for _ in range(200):  # bounded: the aborts and the last steps finish
                if [await w.check_integrity() for w in workers] == [0] * len(workers):
                    break
                await asyncio.sleep(0.02)
            assert [await w.check_integrity() for w in workers] == [0] * len(workers)
        finally:
            for w in workers:
                await w.shutdown()


async def _collect(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams,
                   started: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    if started is not None:
        started.set()
    async for out in dispatcher.generate(rid, prompt, params):
        tokens += out.new_token_ids
    return tokens


def test_disaggregated_over_the_channels_equals_offline():
    prompts = _prompts(10, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = _offline(prompts, params)

    async def main() -> None:
        cluster = _Cluster(num_prefill=1)
        dispatcher = Dispatcher("r0", cluster.workers, poll_timeout_s=0.2, config=REMOTE)
        try:
            tokens = await asyncio.wait_for(asyncio.gather(
                *(_collect(dispatcher, str(i), p, params) for i, p in enumerate(prompts))), 120)
            assert tokens == offline
            calls = cluster.calls["p0"]
            assert calls == [Call.PREFILL] * len(prompts)  # one call a prompt, over the channel, its lease in it
            assert len(cluster.prefill[0].channel._connections) == 1
            assert (await cluster.prefill[0].stats()).num_channels == 1
        finally:
            await dispatcher.close()
            await cluster.close()

    asyncio.run(main())


def test_a_lost_prefill_connection_moves_its_prompts_to_another_prefill_worker():
    prompts = _prompts(8, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    offline = _offline(prompts, params)

    async def main() -> None:
        cluster = _Cluster(num_prefill=2)
        p0, p1 = cluster.prefill
        # p0 first: until its connection goes, it is the only prefill worker the router knows
        dispatcher = Dispatcher("r0", Workers.of(prefill={"p0": cluster.workers.prefill["p0"]},
                                              decode=cluster.workers.decode), poll_timeout_s=0.2, config=REMOTE)
        gate = asyncio.Event()  # p0's prefills wait here: the connection goes while they are on it
        inner = p0.channel.handlers[Call.PREFILL]
        waiting: list[int] = []

        async def held(*args: Any) -> Any:
            waiting.append(1)
            await gate.wait()
            return await inner(*args)

        p0.channel.handlers[Call.PREFILL] = held
        try:
            tasks = [asyncio.ensure_future(_collect(dispatcher, str(i), p, params)) for i, p in enumerate(prompts)]
            for _ in range(500):  # bounded: every prompt reaches p0
                if len(waiting) == len(prompts):
                    break
                await asyncio.sleep(0.01)
            assert len(waiting) == len(prompts)
            dispatcher.set_workers(cluster.workers)  # p1 joins
            for task in list(p0.channel._connections):  # p0's end of the connection goes; p0 lives on
                task.cancel()
            gate.set()
            tokens = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert tokens == offline  # each prompt prefilled again on p1, its stream exact
            assert dispatcher.num_migrations == len(prompts)
            assert cluster.calls["p1"].count(Call.PREFILL) == len(prompts)
            assert Call.PREFILL not in cluster.calls["p0"]  # the connection went before any of them ran there
            assert cluster.calls["p0"].count(Call.ABORT) >= len(prompts)  # each attempt aborted where it was
        finally:
            await dispatcher.close()
            await cluster.close()

    asyncio.run(main())


def test_prompts_queued_in_the_engine_when_their_connection_goes_leave_nothing_held():
    """A prefill call cancelled (its router's connection went) while its prompt waits in the engine:
    the prompt is aborted there, not computed into KV nobody frees (a worker left holding blocks never
    drains: a flip of it waited for good); the router prefills it again and the tokens are exact."""
    prompts = _prompts(6, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline = _offline(prompts, params)

    async def main() -> None:
        cluster = _Cluster(num_prefill=2)
        p0 = cluster.prefill[0]
        dispatcher = Dispatcher("r0", Workers.of(prefill={"p0": cluster.workers.prefill["p0"]},
                                              decode=cluster.workers.decode), poll_timeout_s=0.2, config=REMOTE)
        first_gate, engine_gate = threading.Event(), threading.Event()
        p0.loop.submit(lambda e: first_gate.wait(30))  # p0's engine thread waits: the prompts' calls queue behind
        try:
            tasks = [asyncio.ensure_future(_collect(dispatcher, str(i), p, params)) for i, p in enumerate(prompts)]
            for _ in range(500):  # bounded: every prompt's call reached p0 and waits on its engine
                if len(p0.jobs) == len(prompts):
                    break
                await asyncio.sleep(0.01)
            assert len(p0.jobs) == len(prompts)
            p0.loop.submit(lambda e: engine_gate.wait(30))  # behind the prompts: they join, no step runs
            first_gate.set()
            for _ in range(500):  # bounded: every prompt is in p0's engine, waiting for a step
                if all(job.state is JobState.COMPUTING for job in p0.jobs.values()):
                    break
                await asyncio.sleep(0.01)
            assert all(job.state is JobState.COMPUTING for job in p0.jobs.values())
            dispatcher.set_workers(cluster.workers)  # p1 joins: the prompts go there next
            for task in list(p0.channel._connections):  # the connection goes; the calls under way are cancelled
                task.cancel()
            for _ in range(500):  # bounded: the cancelled jobs end
                if not p0.jobs:
                    break
                await asyncio.sleep(0.01)
            assert not p0.jobs
            engine_gate.set()  # p0's engine steps again: the prompts it was given run, unless they were aborted
            tokens = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert tokens == offline
        finally:
            first_gate.set()
            engine_gate.set()
            await dispatcher.close()
            await cluster.close()  # asserts no worker holds a block

    asyncio.run(main())
