"""`prefill_locally`: a decode worker computes a prompt itself (no lease, no prefill worker) and
streams the offline engine's tokens; it declines, changing nothing, when draining, when the
prompt's blocks cannot be had, or when its prefix cache holds less of the prompt than asked."""

from __future__ import annotations

import asyncio

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from protocol.messages import (
    GenerateRequestMsg,
    LocalPrefillMsg,
    LocalPrefillReplyMsg,
    ReserveMsg,
    TokenBatchMsg,
)

ENGINE = {"device": "cpu", "block_size": 8, "num_blocks": 16}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: 5 full blocks


def _worker() -> DecodeWorker:
    return DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine_config(**ENGINE), transport="local"),
        transport_options={"hub": LocalHub()},
    )


async def _ask(worker: DecodeWorker, rid: str, prompt: list[int], min_cached_tokens: int = 0) -> LocalPrefillReplyMsg:
    request = GenerateRequestMsg(request_id=rid, prompt_token_ids=prompt, params=GREEDY, router_id="r")
    local = LocalPrefillMsg(request=request, min_cached_tokens=min_cached_tokens)
    return LocalPrefillReplyMsg.decode(await worker.prefill_locally(local.encode()))


async def _tokens(worker: DecodeWorker, rid: str) -> tuple[list[int], int]:
    """The request's tokens and its num_cached_tokens, polled until it finishes (bounded)."""
    tokens: list[int] = []
    for _ in range(100):
        for out in TokenBatchMsg.decode(await worker.poll("r", 0.5)).outputs:
            assert out.request_id == rid and out.error is None
            tokens += out.new_token_ids
            if out.finish_reason is not None:
                return tokens, out.num_cached_tokens
    raise AssertionError(f"request {rid} did not finish")


def test_prefill_locally_gives_the_offline_tokens_and_reuses_the_prefix_cache():
    longer = PROMPT + [7, 8, 9, 10]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate([PROMPT, longer], GREEDY)]

    async def main():
        worker = _worker()
        reply = await _ask(worker, "a", PROMPT)
        assert reply.accepted and reply.num_cached_tokens == 0
        assert await _tokens(worker, "a") == (offline[0], 0)
        # the first prompt's blocks are in the prefix cache now: asking for them is granted
        reply = await _ask(worker, "b", longer, min_cached_tokens=32)
        assert reply.accepted and reply.num_cached_tokens == 40
        assert await _tokens(worker, "b") == (offline[1], 40)
        assert await worker.check_integrity() == 0
        await worker.shutdown()

    asyncio.run(main())


def test_prefill_locally_declines_and_changes_nothing():
    async def main():
        worker = _worker()
        # less cached than asked for
        reply = await _ask(worker, "a", PROMPT, min_cached_tokens=8)
        assert not reply.accepted and "0 prompt tokens cached here, fewer than 8" in reply.reason
        # no room: a lease holds 12 of the 16 blocks; the prompt and its first token need 6
        lease = await worker.reserve(ReserveMsg(request_id="l", num_prompt_tokens=95, router_id="r").encode())
        assert lease is not None
        reply = await _ask(worker, "b", PROMPT)
        assert not reply.accepted and "6 KV blocks for the prompt cannot be had (4 free" in reply.reason
        await worker.abort("l")
        # draining
        await worker.drain()
        reply = await _ask(worker, "c", PROMPT)
        assert not reply.accepted and "draining" in reply.reason
        stats = await worker.stats()
        assert stats.num_waiting == stats.num_running == stats.num_undelivered == 0
        assert worker.router_of_request == {}
        assert await worker.check_integrity() == 0
        await worker.shutdown()

    asyncio.run(main())
