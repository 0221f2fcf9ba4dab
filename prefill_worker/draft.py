"""DraftKv: a prefill worker's copy of the decode workers' draft model, which computes each prompt's
draft KV after its first token (on its own CUDA stream, beside the next target step) and hands it
to the push, so a decode worker running the same draft adopts it instead of computing the prompt
inside a step of its batch (bench/results/draft_kv_*). Prompts longer than one engine step are left
to the decode worker's draft. It knows nothing of pairs, leases or routers.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from engine.rank import resolve_device, resolve_dtype, resolve_model_dir
from engine.models import load_arch
from engine.spec.draft_prefill import DraftPrefiller, split_to_fit
from kvtransfer import KvLayout, gather_blocks
from prefill_worker.config import PrefillWorkerConfig
from protocol.messages import DraftKvOffer

log = logging.getLogger(__name__)

_DraftJob = tuple[list[int], "asyncio.Future[torch.Tensor]"]  # a prompt, and where its draft KV goes


class DraftKv:
    def __init__(self, config: PrefillWorkerConfig) -> None:
        m = config.engine.model
        device = resolve_device(m.device)
        self.prefiller = DraftPrefiller(
            config.engine.speculative, m, load_arch(resolve_model_dir(m.model)), device, resolve_dtype(m.dtype, device),
            config.engine.cache.block_size, config.engine.scheduler.max_num_batched_tokens,
        )
        self.device = device
        self.layout = KvLayout.from_kv(self.prefiller.kv_caches)
        self.offer = DraftKvOffer(layout=self.layout.to_ints().tolist(), fingerprint=self.prefiller.fingerprint)
        self._buffers: dict[str, asyncio.Future[torch.Tensor]] = {}  # request -> its draft KV, once computed

    def want(self, request_id: str, prompt: list[int], aio: asyncio.AbstractEventLoop) -> DraftKvOffer | None:
        """Event loop, before the prompt is queued: the offer to send with its KvReady, or None."""
        if not self.prefiller.fits(len(prompt)):
            return None
        self._buffers[request_id] = aio.create_future()
        return self.offer

    def claim(self, done: list[tuple[str, list[int]]]) -> list[_DraftJob]:  # engine thread
        """The prompts a step finished whose draft KV is wanted, with where it goes. NOTE: taken
        before their answers can go (after them, a push may take the future from here)."""
        return [(prompt, future) for rid, prompt in done if (future := self._buffers.get(rid)) is not None]

    def compute(self, jobs: list[_DraftJob], aio: asyncio.AbstractEventLoop) -> None:  # engine thread
        """The draft's KV of claimed prompts, each gathered into one buffer, resolved on the event loop.
        NOTE: called after the first tokens are on their way."""
        if not jobs:
            return
        prompts = [prompt for prompt, _ in jobs]
        wanted = [future for _, future in jobs]
        draft = self.prefiller
        buffers: list[torch.Tensor | BaseException] = []
        try:
            with draft.stream_context():
                for group in split_to_fit(prompts, draft.num_blocks, draft.block_size):
                    blocks = draft.prefill([prompts[i] for i in group])
                    buffers += [gather_blocks(draft.kv_caches, block_ids) for block_ids in blocks]
        except Exception as err:  # noqa: BLE001 - those decode workers get a stand-in (they draft poorly, exactly)
            log.error("draft prefill failed: %s", err)
            buffers = [err] * len(wanted)
        aio.call_soon_threadsafe(_resolve, wanted, buffers)

    async def buffer(self, request_id: str, num_blocks: int, timeout_s: float) -> torch.Tensor:
        """The request's draft KV once computed; a stand-in of its size when there is none (the
        decode side posted a receive for it, and the pair's order must hold)."""
        future = self._buffers.pop(request_id, None)
        if future is not None:
            try:
                return await asyncio.wait_for(future, timeout_s)
            except Exception as err:  # noqa: BLE001 - logged; the stand-in keeps the pair's order
                log.error("no draft KV for %s (%s: %s); sending a stand-in", request_id, type(err).__name__, err)
        with self.prefiller.stream_context():
            return torch.empty(self.layout.buffer_shape(num_blocks), dtype=self.layout.torch_dtype, device=self.device)

    def forget(self, request_id: str) -> None:
        future = self._buffers.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def stream_context(self):  # noqa: ANN201 - a context manager
        """Sends of the draft's KV go inside it: ordered after the draft's writes."""
        return self.prefiller.stream_context()


def _resolve(futures: list[asyncio.Future[torch.Tensor]], buffers: list[torch.Tensor | BaseException]) -> None:
    for future, buf in zip(futures, buffers):
        if future.done():
            continue
        if isinstance(buf, BaseException):
            future.set_exception(buf)
            future.exception()  # NOTE: marks it read: a push that no longer waits logs nothing
        else:
            future.set_result(buf)


__all__ = ["DraftKv"]
