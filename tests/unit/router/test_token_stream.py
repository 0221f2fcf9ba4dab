"""The token stream between a decode worker and the router: TokenBatchMsg's encoding, and the
Dispatcher handing a request's outputs that piled up while it was busy to its consumer as one
(tokens, logprobs and the finish kept in order), never across an error."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from protocol.messages import GenerateRequestMsg, TokenBatchMsg, TokenOutputMsg
from router import Dispatcher, RequestFailedError, Workers
from router.dispatch import DispatcherConfig


def test_token_batch_round_trip() -> None:
    outputs = [
        TokenOutputMsg("a", [5, 6], [-0.5, -1.0], [[(5, -0.5)], [(6, -1.0), (7, -2.0)]], None, 12, 8),
        TokenOutputMsg("b", [], finish_reason="abort", error="decode worker d0 failed"),
    ]
    back = TokenBatchMsg.decode(TokenBatchMsg("d0", outputs).encode())
    assert back.worker_id == "d0"
    assert [o.request_id for o in back.outputs] == ["a", "b"]
    assert back.outputs[0].new_token_ids == [5, 6] and back.outputs[0].logprobs == [-0.5, -1.0]
    assert [[tuple(t) for t in top] for top in back.outputs[0].top_logprobs] == [[(5, -0.5)], [(6, -1.0), (7, -2.0)]]
    assert back.outputs[0][4:7] == (None, 12, 8)
    assert back.outputs[1].error == "decode worker d0 failed" and back.outputs[1].finish_reason == "abort"


def test_token_batch_refuses_rows_of_another_shape() -> None:
    import msgpack

    raw = msgpack.packb(("d0", [["a", [1], None]]))
    with pytest.raises(ValueError, match="a row has 3 fields, a TokenOutputMsg 8"):
        TokenBatchMsg.decode(raw)


class _ScriptedWorker:
    """A colocated worker whose first poll after a submit answers every scripted output at once
    (as a worker does when its router fell behind by several steps)."""

    def __init__(self, script: list[list[TokenOutputMsg]]) -> None:
        self.script = script  # per submit (attempt): its outputs, request ids filled in on submit
        self.ready: list[TokenOutputMsg] = []
        self.event = asyncio.Event()
        self.num_polls_with_news = 0

    async def submit(self, raw: bytes) -> None:
        msg = GenerateRequestMsg.decode(raw)
        self.ready += [o._replace(request_id=msg.request_id) for o in self.script.pop(0)]
        self.event.set()

    async def poll(self, router_id: str, timeout_s: float = 1.0) -> bytes:
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except TimeoutError:
            pass
        self.event.clear()
        outputs, self.ready = self.ready, []
        self.num_polls_with_news += bool(outputs)
        return TokenBatchMsg("w0", outputs).encode()

    async def abort(self, request_id: str) -> bool:
        return True

    async def stats(self) -> dict:
        return {"worker_id": "w0", "num_running": 0, "num_waiting": 0, "num_free_blocks": 100, "num_total_blocks": 100}


async def _outputs(worker: _ScriptedWorker, params: SamplingParams) -> list[TokenOutputMsg]:
    dispatcher = Dispatcher("r0", Workers.of(prefill={}, decode={"w0": worker}), poll_timeout_s=0.2,
                            config=DispatcherConfig(max_attempts=2))
    try:
        return await asyncio.wait_for(_collect(dispatcher.generate("q", [1, 2, 3], params)), 10)
    finally:
        await dispatcher.close()


async def _collect(stream) -> list[TokenOutputMsg]:
    return [out async for out in stream]


def test_outputs_waiting_together_leave_as_one() -> None:
    steps = [TokenOutputMsg("", [10 + i], [-0.1 * i], [[(10 + i, -0.1 * i)]], None, 3, 0) for i in range(4)]
    steps[-1] = steps[-1]._replace(finish_reason="length")
    worker = _ScriptedWorker([steps])
    outs = asyncio.run(_outputs(worker, SamplingParams(max_tokens=4, logprobs=1)))
    assert worker.num_polls_with_news == 1
    assert len(outs) == 1, "four steps' outputs that arrived in one batch should reach the consumer as one"
    (out,) = outs
    assert out.request_id == "q" and out.new_token_ids == [10, 11, 12, 13] and out.finish_reason == "length"
    assert out.logprobs == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert [t[0][0] for t in out.top_logprobs] == [10, 11, 12, 13]


def test_tokens_before_an_error_are_kept_and_the_error_moves_the_request() -> None:
    """Tokens, then the worker's error in the same batch: the tokens reach the client, the error is
    not merged into them; the request continues in a second attempt from where it was."""
    first = [TokenOutputMsg("", [7], num_prompt_tokens=3), TokenOutputMsg("", [8], num_prompt_tokens=3),
             TokenOutputMsg("", [], finish_reason="abort", error="engine died")]
    second = [TokenOutputMsg("", [9], finish_reason="length", num_prompt_tokens=5)]
    worker = _ScriptedWorker([first, second])
    outs = asyncio.run(_outputs(worker, SamplingParams(max_tokens=3)))
    assert [o.new_token_ids for o in outs] == [[7, 8], [9]]
    assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == 3


def test_an_error_alone_fails_the_request_after_max_attempts() -> None:
    error = [TokenOutputMsg("", [], finish_reason="abort", error="engine died")]
    worker = _ScriptedWorker([list(error), list(error)])
    with pytest.raises(RequestFailedError, match="failed 2 times"):
        asyncio.run(_outputs(worker, SamplingParams(max_tokens=3)))


def test_token_batch_carries_when_it_was_sent() -> None:
    """The worker's send time goes with the batch (a router on its host reads the transit from
    it); a batch without one, from an older worker, reads as 0.0."""
    import msgpack

    back = TokenBatchMsg.decode(TokenBatchMsg("d0", [TokenOutputMsg("r", [1])], sent_at=12.5).encode())
    assert back.sent_at == 12.5 and back.outputs[0].new_token_ids == [1]
    assert TokenBatchMsg.decode(msgpack.packb(("d0", []))).sent_at == 0.0
