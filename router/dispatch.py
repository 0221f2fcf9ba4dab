"""Dispatcher: drives one request through the workers and streams its tokens back.

Disaggregated: reserve a lease on a decode worker -> prefill (which pushes the KV) -> first token
-> the decode worker's token batches. Colocated: submit to one worker -> its token batches.
One poller task per decode worker fetches that worker's TokenBatchMsg for this router and fans
the outputs out to the requests' queues. Knows nothing of HTTP, text or Ray pools: it is handed
the workers' handles (Ray actor handles, or the worker objects themselves in-process).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import SamplingParams
from kvtransfer.protocol import (
    GenerateRequestMsg,
    LeaseMsg,
    PrefillResultMsg,
    PrefillTaskMsg,
    ReserveMsg,
    TokenBatchMsg,
    TokenOutputMsg,
)

log = logging.getLogger(__name__)


class NoCapacityError(RuntimeError):
    """Every decode worker is full: the caller should retry later (HTTP 503 with Retry-After)."""


class RequestFailedError(RuntimeError):
    """A worker failed the request; the message says where and why."""


@dataclass(frozen=True)
class Workers:
    prefill: Mapping[str, Any]  # worker id -> handle; empty in colocated mode
    decode: Mapping[str, Any]  # worker id -> handle (colocated workers in colocated mode)

    @property
    def is_colocated(self) -> bool:
        return not self.prefill


async def invoke(method: Any, *args: Any) -> Any:
    """Calls a worker method: a Ray actor method (`.remote`) or an in-process coroutine function."""
    remote = getattr(method, "remote", None)
    return await (remote(*args) if remote is not None else method(*args))


class Dispatcher:
    def __init__(
        self,
        router_id: str,
        workers: Workers,
        poll_timeout_s: float = 1.0,
        on_prefill_result: Callable[[PrefillResultMsg], None] | None = None,
    ) -> None:
        self.router_id = router_id
        self.on_prefill_result = on_prefill_result  # metrics: prefill and KV-push timings
        self.workers = workers
        self.poll_timeout_s = poll_timeout_s
        self._streams: dict[str, asyncio.Queue[TokenOutputMsg]] = {}
        self._worker_of: dict[str, str] = {}  # request id -> the decode (or colocated) worker streaming it
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._round_robin = itertools.count()

    # ---- the token stream
    def _ensure_pollers(self) -> None:
        for worker_id, handle in self.workers.decode.items():
            task = self._pollers.get(worker_id)
            if task is None or task.done():
                self._pollers[worker_id] = asyncio.get_running_loop().create_task(self._poll(worker_id, handle))

    async def _poll(self, worker_id: str, handle: Any) -> None:
        while True:
            try:
                batch = TokenBatchMsg.decode(await invoke(handle.poll, self.router_id, self.poll_timeout_s))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the worker is gone: fail its requests, stop polling
                log.warning("polling %s failed: %s", worker_id, err)
                self._fail_requests_of(worker_id, f"decode worker {worker_id} failed: {err}")
                return
            for out in batch.outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _fail_requests_of(self, worker_id: str, error: str) -> None:
        for request_id, owner in list(self._worker_of.items()):
            queue = self._streams.get(request_id)
            if owner == worker_id and queue is not None:
                queue.put_nowait(TokenOutputMsg(request_id=request_id, new_token_ids=[], finish_reason="abort", error=error))

    def set_workers(self, workers: Workers) -> None:
        """Takes a new worker set (a worker was replaced); requests on workers that left fail."""
        for worker_id in set(self.workers.decode) - set(workers.decode):
            task = self._pollers.pop(worker_id, None)
            if task is not None:
                task.cancel()
            self._fail_requests_of(worker_id, f"decode worker {worker_id} left the cluster")
        self.workers = workers

    async def close(self) -> None:
        for task in self._pollers.values():
            task.cancel()
        await asyncio.gather(*self._pollers.values(), return_exceptions=True)
        self._pollers.clear()

    # ---- one request
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenOutputMsg]:
        """Yields the request's token outputs; the last has a finish_reason. Leaving early
        (client gone) aborts it on every worker that holds something of it."""
        self._ensure_pollers()
        queue: asyncio.Queue[TokenOutputMsg] = asyncio.Queue()
        self._streams[request_id] = queue
        request = GenerateRequestMsg(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, router_id=self.router_id
        )
        touched: list[Any] = []
        is_finished = False
        try:
            if self.workers.is_colocated:
                await self._submit_colocated(request, touched)
            else:
                first = await self._prefill(request, touched)
                yield first
                if first.finish_reason is not None:
                    is_finished = True
                    return
            while True:
                out = await queue.get()
                if out.error is not None:
                    is_finished = True  # the worker has freed what it held
                    raise RequestFailedError(out.error)
                yield out
                if out.finish_reason is not None:
                    is_finished = True
                    return
        finally:
            del self._streams[request_id]
            self._worker_of.pop(request_id, None)
            if not is_finished:
                await asyncio.shield(self._abort(request_id, touched))

    async def _submit_colocated(self, request: GenerateRequestMsg, touched: list[Any]) -> None:
        ids = list(self.workers.decode)
        worker_id = ids[next(self._round_robin) % len(ids)]
        handle = self.workers.decode[worker_id]
        touched.append(handle)
        self._worker_of[request.request_id] = worker_id
        await invoke(handle.submit, request.encode())

    async def _reserve(self, request: GenerateRequestMsg) -> tuple[str, LeaseMsg]:
        ids = list(self.workers.decode)
        start = next(self._round_robin)
        reserve = ReserveMsg(
            request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids), router_id=self.router_id
        ).encode()
        for i in range(len(ids)):
            worker_id = ids[(start + i) % len(ids)]
            lease = await invoke(self.workers.decode[worker_id].reserve, reserve)
            if lease is not None:
                return worker_id, LeaseMsg.decode(lease)
        raise NoCapacityError(f"no decode worker has KV blocks for {len(request.prompt_token_ids)} prompt tokens")

    async def _prefill(self, request: GenerateRequestMsg, touched: list[Any]) -> TokenOutputMsg:
        decode_id, lease = await self._reserve(request)
        decode = self.workers.decode[decode_id]
        touched.append(decode)
        self._worker_of[request.request_id] = decode_id
        ids = list(self.workers.prefill)
        prefill = self.workers.prefill[ids[next(self._round_robin) % len(ids)]]
        touched.append(prefill)
        task = PrefillTaskMsg(request=request, lease=lease).encode()
        result = PrefillResultMsg.decode(await invoke(prefill.prefill, task, decode))
        if self.on_prefill_result is not None:
            self.on_prefill_result(result)
        if result.error is not None:
            raise RequestFailedError(result.error)
        if result.finish_reason is not None:
            await invoke(decode.abort, request.request_id)  # the lease is not needed: free it now
        return TokenOutputMsg(
            request_id=request.request_id,
            new_token_ids=[result.first_token] if result.first_token is not None else [],
            logprobs=[result.logprob] if result.logprob is not None else None,
            top_logprobs=[result.top_logprobs] if result.top_logprobs is not None else None,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
        )

    async def _abort(self, request_id: str, touched: list[Any]) -> None:
        for handle in touched:
            try:
                await invoke(handle.abort, request_id)
            except Exception as err:  # noqa: BLE001 - a dead worker holds nothing any more
                log.warning("abort of %s failed: %s", request_id, err)
