"""Decode workers reached over the request channel (protocol/channel.py), in one process without
Ray: the Dispatcher holds only clients with channels, so every submit, reserve, abort and token batch
crosses a real socket. Greedy tokens equal the offline engine's, colocated and disaggregated; a
connection lost mid-stream moves the worker's requests to another worker, whose tokens continue
the stream exactly, and the abort that follows frees them on the first; no block is held after."""

from __future__ import annotations

import asyncio
import random

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.channel import Call, ChannelClient
from protocol.clients import DecodeClient
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


def _decode(worker_id: str, hub: LocalHub) -> DecodeWorker:
    return DecodeWorker(DecodeWorkerConfig(worker_id=worker_id, engine=engine_config(**ENGINE), transport="local"),
                        transport_options={"hub": hub})


def _over_channel(worker: DecodeWorker) -> tuple[DecodeClient, ChannelClient]:
    client = ChannelClient(worker.worker_id, worker.channel_address, connect_timeout_s=5.0)
    return DecodeClient(worker.worker_id, worker, client), client


async def _collect(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams,
                   seen: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    async for out in dispatcher.generate(rid, prompt, params):
        tokens += out.new_token_ids
        if seen is not None and len(tokens) >= 2:
            seen.set()
    return tokens


def test_colocated_and_disaggregated_over_the_channel_equal_offline():
    prompts = _prompts(12)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def run(colocated: bool) -> list[list[int]]:
        hub = LocalHub()
        decode = _decode("d0", hub)
        handle, client = _over_channel(decode)
        workers = [decode]
        prefill = {}
        if not colocated:
            p0 = PrefillWorker(PrefillWorkerConfig(worker_id="p0", engine=engine_config(**ENGINE), transport="local"),
                               transport_options={"hub": hub})
            workers.append(p0)
            prefill = {"p0": p0}
        config = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))
        dispatcher = Dispatcher("r0", Workers.of(prefill=prefill, decode={"d0": handle}), poll_timeout_s=0.2,
                                config=config)
        try:
            tokens = await asyncio.wait_for(asyncio.gather(
                *(_collect(dispatcher, str(i), p, GREEDY) for i, p in enumerate(prompts))), 120)
            assert len(decode.channel._connections) == 1  # every call and the stream on one connection
            return tokens
        finally:
            await dispatcher.close()
            client.close()
            assert [await w.check_integrity() for w in workers] == [0] * len(workers)
            for w in workers:
                await w.shutdown()

    assert asyncio.run(run(colocated=True)) == offline
    assert asyncio.run(run(colocated=False)) == offline


def test_a_lost_connection_moves_the_requests_and_the_abort_frees_them():
    prompts = _prompts(8, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        hub = LocalHub()
        d0, d1 = _decode("d0", hub), _decode("d1", hub)
        h0, c0 = _over_channel(d0)
        h1, c1 = _over_channel(d1)
        dispatcher = Dispatcher("r0", Workers.of(prefill={}, decode={"d0": h0}), poll_timeout_s=0.2)
        seen = asyncio.Event()
        aborted: list[str] = []  # aborts that reached d0 over its channel
        abort = d0.channel.handlers[Call.ABORT]

        async def counting_abort(request_id: str) -> bool:
            aborted.append(request_id)
            return await abort(request_id)

        d0.channel.handlers[Call.ABORT] = counting_abort
        try:
            tasks = [asyncio.ensure_future(_collect(dispatcher, str(i), p, params, seen))
                     for i, p in enumerate(prompts)]
            await asyncio.wait_for(seen.wait(), 60)
            dispatcher.set_workers(Workers.of(prefill={}, decode={"d0": h0, "d1": h1}))
            for task in list(d0.channel._connections):  # d0's end of the connection goes; d0 lives on
                task.cancel()
            tokens = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert dispatcher.num_migrations > 0
            assert len(aborted) == dispatcher.num_migrations  # each moved attempt aborted where it was
            assert tokens == offline  # nothing lost or repeated across the move
            for _ in range(200):  # bounded: the aborts (over a new connection) and the steps finish
                if await d0.check_integrity() == 0:
                    break
                await asyncio.sleep(0.02)
            assert [await d0.check_integrity(), await d1.check_integrity()] == [0, 0]
        finally:
            await dispatcher.close()
            c0.close()
            c1.close()
            for w in (d0, d1):
                await w.shutdown()

    asyncio.run(main())
