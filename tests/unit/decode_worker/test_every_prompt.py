"""A decode worker with no prefill pool left computes every prompt it is sent: its steps drop the
inter-token latency budget (a colocated worker's prompts starved under it) and it says so in its stats;
told otherwise, or rebuilt over a kept engine (a role change), the budget is back."""

from __future__ import annotations

import asyncio

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine.llm import engine_config
from kvtransfer import LocalHub


def test_computing_every_prompt_drops_the_step_budget_and_says_so():
    config = DecodeWorkerConfig(worker_id="d0", engine=engine_config(device="cpu", num_blocks=64, itl_budget_ms=30.0),
                                transport="local")

    async def main():
        worker = DecodeWorker(config, transport_options={"hub": LocalHub()})
        engine = worker.loop.engine
        assert engine.itl_budget_ms == 30.0 and not (await worker.stats()).computes_every_prompt
        await worker.computes_every_prompt(True)
        assert engine.itl_budget_ms is None and (await worker.stats()).computes_every_prompt
        await worker.computes_every_prompt(False)
        assert engine.itl_budget_ms == 30.0 and not (await worker.stats()).computes_every_prompt
        await worker.computes_every_prompt(True)
        await worker.shutdown(keep_engine=True)
        again = DecodeWorker(config, transport_options={"hub": LocalHub()}, engine=engine)  # a role change back
        assert engine.itl_budget_ms == 30.0 and not (await again.stats()).computes_every_prompt
        assert await again.check_integrity() == 0
        await again.shutdown()

    asyncio.run(main())
