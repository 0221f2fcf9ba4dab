"""A draining decode worker takes no new lease or request, finishes what it runs, and says so."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.messages import GenerateRequestMsg, ReserveMsg, TokenBatchMsg


def test_drain_refuses_new_work_and_finishes_running_work():
    async def main():
        worker = DecodeWorker(
            DecodeWorkerConfig(worker_id="d0", engine=engine_config(device="cpu", num_blocks=64), transport="local"),
            transport_options={"hub": LocalHub()},
        )
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        running = GenerateRequestMsg(request_id="a", prompt_token_ids=[5, 6, 7], params=params, router_id="r")
        await worker.submit(running.encode())
        await worker.drain()
        assert await worker.reserve(ReserveMsg(request_id="b", num_prompt_tokens=4, router_id="r").encode()) is None
        late = GenerateRequestMsg(request_id="c", prompt_token_ids=[5], params=params, router_id="r")
        with pytest.raises(RuntimeError, match="draining"):
            await worker.submit(late.encode())
        tokens, finished = 0, False
        for _ in range(200):  # bounded: 30 tokens arrive in a few polls
            batch = TokenBatchMsg.decode(await worker.poll("r", 0.5))
            for out in batch.outputs:
                tokens += len(out.new_token_ids)
                finished = finished or out.finish_reason is not None
            if finished:
                break
        stats = await worker.stats()
        assert finished and tokens == 30
        assert stats.is_draining and stats.num_running == 0 and stats.num_undelivered == 0
        assert await worker.check_integrity() == 0
        await worker.shutdown()

    asyncio.run(main())
