"""A decode worker's step outputs on their way to the routers: one TokenOutputMsg a request, field
for field the engine's StepOutput, in the step's order, in its own router's outbox; a request
aborted meanwhile gets nothing, a finished one is forgotten; each router's poller woken once a
step. With freeze_gc the worker's startup objects leave the collector's reach (engine/process_gc.py)."""

from __future__ import annotations

import asyncio

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import StepOutput
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.messages import TokenBatchMsg, TokenOutputMsg
from tests.gc_freeze import check_freeze_gc


def _worker(**options) -> DecodeWorker:
    return DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine_config(device="cpu", num_blocks=16), transport="local",
                           **options),
        transport_options={"hub": LocalHub()},
    )


class _CountingEvent(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self.num_sets = 0

    def set(self) -> None:
        self.num_sets += 1
        super().set()


def test_a_step_reaches_each_router_once_field_for_field() -> None:
    async def main() -> None:
        worker = _worker()
        worker.router_of_request.update({"a": "r1", "b": "r2", "c": "r1"})
        events = {r: _CountingEvent() for r in ("r1", "r2")}
        for router_id, event in events.items():
            worker._outbox(router_id).ready = event
        step = [
            StepOutput("a", [5], None, None, None, 3, 0),
            StepOutput("gone", [6], None, None, None, 4, 0),  # aborted after the step was scheduled
            StepOutput("b", [7, 8], [-0.5, -1.5], [[(7, -0.5)], [(8, -1.5), (9, -2.0)]], "length", 5, 2),
            StepOutput("c", [9], None, None, "stop", 6, 1),
        ]
        worker._deliver_step(step)
        assert {r: e.num_sets for r, e in events.items()} == {"r1": 1, "r2": 1}
        assert worker.router_of_request == {"a": "r1"}  # the finished ones forgotten
        expected = {
            "r1": [TokenOutputMsg("a", [5], None, None, None, 3, 0),
                   TokenOutputMsg("c", [9], None, None, "stop", 6, 1)],
            "r2": [TokenOutputMsg("b", [7, 8], [-0.5, -1.5], [[(7, -0.5)], [(8, -1.5), (9, -2.0)]], "length", 5, 2)],
        }
        for router_id, rows in expected.items():
            assert worker.outboxes[router_id].outputs == rows
            assert all(type(row) is TokenOutputMsg for row in worker.outboxes[router_id].outputs)
            batch = TokenBatchMsg.decode(await worker.poll(router_id, 0.0))
            assert [(o.request_id, o.new_token_ids, o.finish_reason, o.num_cached_tokens, o.error)
                    for o in batch.outputs] == [(o.request_id, o.new_token_ids, o.finish_reason,
                                                 o.num_cached_tokens, None) for o in rows]
        await worker.shutdown()

    asyncio.run(main())


def test_freeze_gc_freezes_the_startup_objects() -> None:
    check_freeze_gc(_worker)
