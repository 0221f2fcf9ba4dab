"""The decode worker answers a KvReady before it posts the receives (DecodeWorker.kv_incoming).

On a GPU a posted NCCL receive spins until its sender sends, and a later CUDA call of the decode
worker's process can wait for it (the engine's first launch of a lazily loaded kernel waits for
the kernels running; measured on 2x H200, a CUDA event recorded for the next receive then blocked
too). The sender sends only after the answer, so an answer given after the receives were posted
could never leave. Here the local transport plays that GPU: posting a receive waits until its
sender has sent. The KV still lands, one request after another, and no block stays held."""

from __future__ import annotations

import asyncio
import random
import threading

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, SamplingParams
from engine.llm import engine_config
from kvtransfer import LocalHub
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from protocol.clients import DecodeClient
from router import Dispatcher, Workers
from router.dispatch import DispatcherConfig, LocalPrefillConfig

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class _SpinningReceives:
    """A receive is posted only once its send has been issued (at most `timeout_s`, then
    TimeoutError: the deadlock the GPU would have had had the answer waited for the post)."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker, timeout_s: float = 3.0) -> None:
        self.posted = self.sent = 0
        self.blocked_event_loop = False
        self.changed = threading.Condition()
        send, recv = prefill.transport.send, decode.transport.recv

        def sending(peer_id, tensor):
            handle = send(peer_id, tensor)
            with self.changed:
                self.sent += 1
                self.changed.notify_all()
            return handle

        def receiving(peer_id, tensor):
            with self.changed:
                if not self.changed.wait_for(lambda: self.sent > self.posted, timeout_s):
                    raise TimeoutError(f"receive {self.posted + 1} waited for a send that never came")
                self.posted += 1
            return recv(peer_id, tensor)

        prefill.transport.send = sending
        decode.transport.recv = receiving


def test_answer_goes_before_the_receives_are_posted():
    """Each request's KV is one receive, posted only after the prefill worker has sent it, which it
    does only once kv_incoming has answered."""
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randrange(9, 40))] for _ in range(3)]
    offline = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, GREEDY)]

    async def main():
        hub = LocalHub()
        decode = DecodeWorker(DecodeWorkerConfig(worker_id="d0", engine=engine_config(**ENGINE), transport="local"),
                              transport_options={"hub": hub})
        prefill = PrefillWorker(PrefillWorkerConfig(worker_id="p0", engine=engine_config(**ENGINE), transport="local"),
                                transport_options={"hub": hub})
        workers = Workers.of(prefill={"p0": prefill}, decode={"d0": decode})
        dispatcher = Dispatcher("r0", workers, poll_timeout_s=0.2,
                                config=DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote")))
        try:
            await prefill.pairs._ensure_pair(
                DecodeClient("d0", decode))  # NOTE: paired first: pairing sends messages of its own
            spinning = _SpinningReceives(prefill, decode)
            tokens = []
            for i, prompt in enumerate(prompts):
                stream = dispatcher.generate(f"r{i}", prompt, GREEDY)
                tokens.append(await asyncio.wait_for(_collect(stream), 30))
            assert tokens == offline
            assert spinning.posted == spinning.sent == len(prompts)  # all matched
        finally:
            await dispatcher.close()
        assert [await prefill.check_integrity(), await decode.check_integrity()] == [0, 0]
        await prefill.shutdown()
        await decode.shutdown()

    asyncio.run(main())


async def _collect(stream) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]
