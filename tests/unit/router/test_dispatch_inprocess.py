"""The whole disaggregated path in one process, without Ray: Dispatcher -> DecodeWorker lease ->
PrefillWorker prefill and KV push over the local transport -> decode -> tokens. Greedy tokens
equal the offline engine's and the colocated mode's, with every prompt through the prefill worker
(prefill rule 'remote') and with the default rule (short prompts prefilled on the decode worker);
aborts at every stage and expired leases leave no block held on either worker. With and without the
early handshake (the decode worker posts its receives while the prompt is computed; the first
token follows the KV over the pair)."""

from __future__ import annotations

import asyncio
import random
import time

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


def _build(colocated: bool = False, lease_ttl_s: float = 30.0, early_handshake: bool = True,
           decode_blocks: int | None = None, **engine_options):
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
        return Workers(prefill={}, decode={"d0": decode}), [decode]
    prefill = PrefillWorker(
        PrefillWorkerConfig(worker_id="p0", engine=engine_config(**options), transport="local",
                            early_handshake=early_handshake),
        transport_options=local,
    )
    return Workers(prefill={"p0": prefill}, decode={"d0": decode}), [prefill, decode]


def _count_handshakes(decode: DecodeWorker) -> dict[str, int]:
    """Counts the decode worker's KvReady messages by kind: 'early' (no first token yet) or 'after'."""
    from kvtransfer.protocol import KvReadyMsg

    counts = {"early": 0, "after": 0}
    kv_incoming = decode.kv_incoming

    async def counting(ready: bytes) -> bytes:
        counts["early" if KvReadyMsg.decode(ready).first_token is None else "after"] += 1
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
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, params)]
    handshakes = {}

    async def main():
        results = {}
        for mode in ("disaggregated", "disaggregated-late-handshake", "disaggregated-lease-first",
                     "disaggregated-default-rule", "colocated"):
            workers, objs = _build(colocated=(mode == "colocated"), early_handshake=mode != "disaggregated-late-handshake")
            if mode != "colocated":
                handshakes[mode] = _count_handshakes(workers.decode["d0"])
            config = {"disaggregated-default-rule": DispatcherConfig(),
                      "disaggregated-lease-first": REMOTE.model_copy(update={"lease_beside_prefill": False})}.get(
                mode, REMOTE)
            results[mode] = await _run_all(workers, prompts, params, config)
            assert await _held(objs) == [0] * len(objs), mode
            await _shutdown(objs)
        return results

    results = asyncio.run(main())
    for mode, tokens in results.items():
        assert tokens == offline, mode
    # Both handshakes ran: early ones while the engine was idle, late ones when prompts queued.
    assert handshakes["disaggregated"]["early"] > 0, handshakes
    assert handshakes["disaggregated-late-handshake"] == {"early": 0, "after": 16}


def test_no_room_at_first_stops_the_prefill_and_waits_for_a_lease():
    """The prefill starts beside the lease (DispatcherConfig.lease_beside_prefill); when the decode
    worker has no room at the first try, that prefill is stopped, and the request leases first and
    then prefills once room comes. Two requests, room for one lease: both get the offline tokens."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [_prompts(1, seed=s)[0][:3] + list(range(100, 157)) for s in (7, 8)]  # 60 tokens: 8 blocks of 8
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        workers, (prefill, decode) = _build(decode_blocks=12)
        calls: list[bool] = []  # per prefill call: whether it came with a lease
        prefill_call = prefill.prefill

        async def counting(task: bytes, decode_worker=None) -> bytes:
            from kvtransfer.protocol import PrefillTaskMsg

            calls.append(PrefillTaskMsg.decode(task).lease is not None)
            return await prefill_call(task, decode_worker)

        prefill.prefill = counting  # type: ignore[method-assign]
        tokens = await _run_all(workers, prompts, params)
        assert tokens == offline
        # Both started beside their lease; one found no room and went again with its lease.
        assert sorted(calls) == [False, False, True], calls
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


def test_a_lease_attached_before_its_prefill_call_runs_waits_for_it():
    """An async Ray actor runs calls in any order: the router's attach_lease may run before the
    prefill call it follows. The lease then waits for that call (else the prefill would wait for a
    lease that never comes, until pair_timeout_s); the request gets the offline tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(3, seed=21)
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        workers, (prefill, decode) = _build()
        prefill.config = prefill.config.model_copy(update={"pair_timeout_s": 3.0})
        prefill_call, attached = prefill.prefill, []
        attach_call = prefill.attach_lease

        async def late(task: bytes, decode_worker=None) -> bytes:
            await asyncio.sleep(0.2)  # NOTE: the router's attach_lease runs first
            return await prefill_call(task, decode_worker)

        async def attach(*args):
            attached.append(await attach_call(*args))
            return attached[-1]

        prefill.prefill, prefill.attach_lease = late, attach  # type: ignore[method-assign]
        tokens = await _run_all(workers, prompts, params)
        assert tokens == offline
        assert attached == [True] * len(prompts)
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


@pytest.mark.parametrize("kv_messages", [1, 2])
def test_kv_goes_layer_group_by_group_during_the_prefill_step(kv_messages):
    """After an early handshake the KV goes from the prefill step, a layer group as soon as its
    layers are computed (PrefillWorkerConfig.kv_messages; the default model has 2 layers), and the
    tokens are the offline engine's. One message is not streamed: it goes once the first token is
    sampled (so its gather and send never run beside the step's last kernels). The race between the
    handshake and the step is settled here by holding the step until the handshake is accepted (in a
    real step that starts first, the groups written by the time it is accepted go then;
    tests/unit/prefill_worker/test_layer_push.py)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4, seed=11)
    offline = [o.outputs.token_ids for o in LLM(**ENGINE).generate(prompts, params)]

    async def main():
        workers, (prefill, decode) = _build()
        prefill.config = prefill.config.model_copy(update={"kv_messages": kv_messages})
        push = prefill.layer_push
        sent_at: list[tuple[int, int]] = []  # (layers computed, groups sent so far) at each hook call

        def hook(scheduled):
            # NOTE: held until the handshake is accepted (the offer), so each group goes as written
            for s in scheduled:
                deadline = time.monotonic() + 5.0
                stream = push._streams.get(s.request.request_id)  # None: not streamed (one message)
                while (s.will_sample and stream is not None and stream.decode_id is None
                       and time.monotonic() < deadline):
                    time.sleep(0.001)
            on_layers = push.hook(scheduled)
            if on_layers is None:
                return None
            rid = next(s.request.request_id for s in scheduled if push.is_claimed(s.request.request_id))

            def spy(num_done):
                on_layers(num_done)
                sent_at.append((num_done, len(push._streams[rid].handles)))

            return spy

        prefill.loop.engine.layer_hook = hook
        results = []
        prefill_call = prefill.prefill

        async def recording(task: bytes, decode_worker=None) -> bytes:
            from kvtransfer.protocol import PrefillResultMsg

            answer = await prefill_call(task, decode_worker)
            results.append(PrefillResultMsg.decode(answer))
            return answer

        prefill.prefill = recording  # type: ignore[method-assign]
        tokens = [(await _run_all(workers, [p], params))[0] for p in prompts]  # one at a time: early handshakes
        assert tokens == offline
        # answered before the push (the default): the push's figures come in the worker's records
        assert [r.push_pending for r in results] == [True] * len(prompts)
        await prefill.settle_pushes()
        from kvtransfer.protocol import PrefillResultMsg

        pushes = [PrefillResultMsg.decode(b) for b in await prefill.push_records()]
        assert [r.request_id for r in pushes] == [r.request_id for r in results]
        streamed = kv_messages if kv_messages > 1 else 0
        assert [r.num_streamed_messages for r in pushes] == [streamed] * len(prompts)
        # The step told of each layer (the sends themselves go on the event loop, as soon as it
        # runs: tests/unit/prefill_worker/test_layer_push.py checks when)
        assert [n for n, _ in sent_at] == ([1, 2] * len(prompts) if kv_messages > 1 else [])
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())


@pytest.mark.parametrize("early_handshake", [True, False], ids=["early", "late"])
def test_first_token_that_ends_the_request_frees_the_lease(early_handshake):
    async def main():
        workers, objs = _build(early_handshake=early_handshake)
        counts = _count_handshakes(workers.decode["d0"])
        for i, prompt in enumerate(_prompts(3)):  # one at a time: the early handshake's conditions hold
            tokens = await _run_all(workers, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
            assert [len(t) for t in tokens] == [1], i
        assert counts["early"] == (3 if early_handshake else 0)
        assert await _held(objs) == [0, 0]
        # The pair is still in order: a request that decodes gets its tokens.
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = _prompts(1, seed=5)[0]
        want = LLM(**ENGINE).generate([prompt], params)[0].outputs.token_ids
        assert await _run_all(workers, [prompt], params) == [want]
        assert await _held(objs) == [0, 0]
        await _shutdown(objs)

    asyncio.run(main())


@pytest.mark.parametrize("early_handshake", [True, False], ids=["early", "late"])
def test_abort_before_push_during_decode_and_unclaimed_lease(early_handshake):
    async def main():
        workers, (prefill, decode) = _build(lease_ttl_s=0.5, early_handshake=early_handshake)
        counts = _count_handshakes(decode)
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
        from kvtransfer.protocol import ReserveMsg

        lease = await decode.reserve(ReserveMsg(request_id="c", num_prompt_tokens=40, router_id="r0").encode())
        assert lease is not None and await decode.check_integrity() > 0
        await asyncio.sleep(1.0)
        assert await _held([prefill, decode]) == [0, 0]
        # (whether the aborted prompt's push started depends on timing; its handshake's kind does not)
        assert (counts["early"] >= 2) if early_handshake else (counts["early"] == 0 and counts["after"] >= 1), counts
        # The pair is still in order after the aborted push: the next request gets its tokens.
        prompt = _prompts(1, seed=6)[0]
        short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        want = LLM(**ENGINE).generate([prompt], short)[0].outputs.token_ids
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
                                                    transport="local", pair_timeout_s=5), transport_options={"hub": hub})
        dispatcher = Dispatcher("r0", Workers(prefill={"p0": prefill}, decode={"d0": decode}), poll_timeout_s=0.2,
                                config=REMOTE)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(RequestFailedError, match=named):
            await asyncio.wait_for(_collect(dispatcher, "x", _prompts(1)[0], params), 60)
        await dispatcher.close()
        assert await _held([prefill, decode]) == [0, 0]
        await _shutdown([prefill, decode])

    asyncio.run(main())
