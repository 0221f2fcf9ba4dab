"""The whole disaggregated path in one process, without Ray: Dispatcher -> DecodeWorker lease ->
PrefillWorker prefill and KV push over the local transport -> decode -> tokens. Greedy tokens
equal the offline engine's and the colocated mode's, with every prompt through the prefill worker
(prefill rule 'remote') and with the default rule (short prompts prefilled on the decode worker);
aborts at every stage and expired leases leave no block held on either worker. One flow: the lease
first, then one prefill call carrying it."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
REMOTE = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))  # every prompt through a prefill worker


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 70))] for _ in range(count)]


def _build(colocated: bool = False, lease_ttl_s: float = 30.0, decode_blocks: int | None = None, **engine_options):
    options = {**ENGINE, **engine_options}
    hub = LocalHub()
    local = {"hub": hub}
    decode_options = {**options, "num_blocks": decode_blocks or options["num_blocks"]}
    decode = DecodeWorker(
        DecodeWorkerConfig(worker_id="d0", engine=engine_config(**decode_options), transport="local",
                           lease_ttl_s=lease_ttl_s),
        transport_options=local,
    )
    if colocated:
        return Workers.of(prefill={}, decode={"d0": decode}), [decode]
    prefill = PrefillWorker(
        PrefillWorkerConfig(worker_id="p0", engine=engine_config(**options), transport="local"),
        transport_options=local,
    )
    return Workers.of(prefill={"p0": prefill}, decode={"d0": decode}), [prefill, decode]


def _count_handshakes(decode: DecodeWorker) -> dict[str, int]:
    """Counts the decode worker's KvReady messages: 'ready' (the KV follows) or 'failed'."""
    from protocol.messages import KvReadyMsg

    counts = {"ready": 0, "failed": 0}
    kv_incoming = decode.kv_incoming

    async def counting(ready: bytes) -> bytes:
        counts["failed" if KvReadyMsg.decode(ready).failure else "ready"] += 1
        return await kv_incoming(ready)

    decode.kv_incoming = counting  # type: ignore[method-assign]
    return counts


async def _collect(dispatcher: Dispatcher, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for out in dispatcher.generate(rid, prompt, params):
        tokens += out.new_token_ids
    return tokens


async def _run_all(workers: Workers, prompts, params, config: DispatcherConfig = REMOTE) -> list[list[int]]:
    dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=config)
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(_collect(dispatcher, str(i), p, params) for i, p in enumerate(prompts))), 120
        )
    finally:
        await dispatcher.close()


async def _held(workers_list) -> list[int]:
    return [await w.check_integrity() for w in workers_list]


async def _shutdown(workers_list) -> None:
    for w in workers_list:
        await w.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_disaggregated_equals_colocated_and_offline(params):
    prompts = _prompts(16)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    handshakes, leases = {}, {}

    async def main():
        results = {}
        for mode in ("disaggregated", "disaggregated-default-rule", "colocated"):
            workers, objs = _build(colocated=(mode == "colocated"))
            if mode != "colocated":
                handshakes[mode] = _count_handshakes(workers.decode["d0"].target)
                leases[mode] = _count_leases(workers.prefill["p0"].target)
            config = DispatcherConfig() if mode == "disaggregated-default-rule" else REMOTE
            results[mode] = await _run_all(workers, prompts, params, config)
            assert await _held(objs) == [0] * len(objs), mode
            await _shutdown(objs)
        return results

    results = asyncio.run(main())
    for mode, tokens in results.items():
        assert tokens == offline, mode
    # One flow: every prompt's one prefill call carried its lease, and its KV went after the answer.
    assert leases["disaggregated"] == [True] * 16
    assert handshakes["disaggregated"] == {"ready": 16, "failed": 0}


def _count_leases(prefill: PrefillWorker) -> list[bool]:
    """Per prefill call: whether it carried the request's lease."""
    from protocol.messages import PrefillTaskMsg

    calls: list[bool] = []
    prefill_call = prefill.prefill

    async def counting(task: bytes, decode_worker=None) -> bytes:
        calls.append(PrefillTaskMsg.decode(task).lease.decode_worker_id == "d0")
        return await prefill_call(task, decode_worker)

    prefill.prefill = counting  # type: ignore[method-assign]
    return calls


def test_no_room_waits_for_a_lease_before_prefilling():
    """Two requests, room for one lease: the second waits for the first's blocks before its prefill
    starts (nothing held on the prefill worker meanwhile); both get the offline tokens."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [_prompts(1, seed=s)[0][:3] + list(range(100, 157)) for s in (7, 8)]  # 60 tokens: 8 blocks of 8
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        workers, (prefill, decode) = _build(decode_blocks=12)
        leases = _count_leases(prefill)
        tokens = await _run_all(workers, prompts, params)
        assert tokens == offline
        assert leases == [True, True]
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


def test_first_token_that_ends_the_request_frees_the_lease():
    async def main():
        workers, objs = _build()
        counts = _count_handshakes(workers.decode["d0"].target)
        for i, prompt in enumerate(_prompts(3)):
            tokens = await _run_all(workers, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
            assert [len(t) for t in tokens] == [1], i
        assert counts == {"ready": 0, "failed": 0}  # nothing to push
        assert await _held(objs) == [0, 0]
        # The pair is still in order: a request that decodes gets its tokens.
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = _prompts(1, seed=5)[0]
        want = LLM(**ENGINE).generate([prompt], params)[0].outputs[0].token_ids
        assert await _run_all(workers, [prompt], params) == [want]
        assert await _held(objs) == [0, 0]
        await _shutdown(objs)

    asyncio.run(main())


def test_abort_before_push_during_decode_and_unclaimed_lease():
    async def main():
        workers, (prefill, decode) = _build(lease_ttl_s=0.5)
        dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2, config=REMOTE)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        # during decode: leave the stream after a few tokens (a client disconnect)
        stream = dispatcher.generate("a", _prompts(1)[0], params)
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
        # before the push: cancel while the prompt is still being prefilled
        task = asyncio.ensure_future(_collect(dispatcher, "b", list(range(4, 900)), params))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # an unclaimed lease: reserved, never prefilled -> freed after its ttl
        from protocol.messages import ReserveMsg

        lease = await decode.reserve(ReserveMsg(request_id="c", num_prompt_tokens=40, router_id="r0").encode())
        assert lease is not None and await decode.check_integrity() > 0
        await asyncio.sleep(1.0)
        assert await _held([prefill, decode]) == [0, 0]
        # The pair is still in order after the aborted push: the next request gets its tokens.
        prompt = _prompts(1, seed=6)[0]
        short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        want = LLM(**ENGINE).generate([prompt], short)[0].outputs[0].token_ids
        assert await _collect(dispatcher, "d", prompt, short) == want
        await dispatcher.close()
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


@pytest.mark.parametrize(("option", "values", "named"), [("block_size", (8, 16), "block_size"),
                                                          ("dtype", ("float32", "float16"), "dtype")])
def test_layout_mismatch_fails_at_pairing_and_names_the_field(option, values, named):
    from router import RequestFailedError

    async def main():
        hub = LocalHub()
        prefill_options = {**ENGINE, option: values[0]}
        decode_options = {**ENGINE, option: values[1]}
        decode = DecodeWorker(DecodeWorkerConfig(worker_id="d0", engine=engine_config(**decode_options),
                                                 transport="local", pair_timeout_s=5), transport_options={"hub": hub})
        prefill = PrefillWorker(PrefillWorkerConfig(worker_id="p0", engine=engine_config(**prefill_options),
                                                    transport="local", pair_timeout_s=5),
                                transport_options={"hub": hub})
        dispatcher = Dispatcher("r0", Workers.of(prefill={"p0": prefill}, decode={"d0": decode}), poll_timeout_s=0.2,
                                config=REMOTE)
        # NOTE: more tokens than attempts: each failed attempt still gives the client its first token
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        with pytest.raises(RequestFailedError, match=named):
            await asyncio.wait_for(_collect(dispatcher, "x", _prompts(1)[0], params), 60)
        await dispatcher.close()
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


def test_colocated_workers_are_chosen_by_the_prompt_tokens_sent_them():
    """Two colocated workers: each request is noted (its uncached tokens) at the worker it goes to
    before the call, so requests arriving together spread by tokens, not by count: after a 300-token
    prompt, six of about 10 tokens all go to the other worker (by count they would split 3 / 3);
    the tokens equal offline."""
    from router.policy import CacheAwarePolicy
    from tests.spy import Spy

    class Noting(CacheAwarePolicy):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.noted: list[tuple[str, int]] = []

        def on_sent(self, worker_id, prompt):
            super().on_sent(worker_id, prompt)
            self.noted.append((worker_id, len(prompt)))

    rng = random.Random(5)
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (300, 9, 10, 11, 12, 10, 9)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        workers = {f"c{i}": Spy(DecodeWorker(DecodeWorkerConfig(worker_id=f"c{i}", engine=engine_config(**ENGINE)),
                                              transport_options={})) for i in range(2)}
        dispatcher = Dispatcher("r0", Workers.of(prefill={}, decode=workers), poll_timeout_s=0.2)
        policy = Noting(loads=dispatcher.loads.loads, clock=dispatcher.loads.clock)
        dispatcher.policy = policy
        try:
            tokens = await asyncio.wait_for(asyncio.gather(
                *(_collect(dispatcher, str(i), p, params) for i, p in enumerate(prompts))), 120)
        finally:
            await dispatcher.close()
        assert tokens == offline
        submitted = {rid: w for w, spy in workers.items() for rid in spy.calls["submit"]}
        assert sorted(submitted) == sorted(str(i) for i in range(len(prompts)))
        assert len(policy.noted) == len(prompts)  # every request noted once
        assert sorted(w for w, _ in policy.noted) == sorted(submitted.values())
        assert set(submitted.values()) == {"c0", "c1"}
        assert [n for w, n in policy.noted if w == submitted["0"]] == [300]  # the short ones all went elsewhere
        assert await _held([s.worker for s in workers.values()]) == [0, 0]
        await _shutdown([s.worker for s in workers.values()])

    asyncio.run(main())
