"""DecodeWorker: leases KV blocks to incoming prompts, receives their KV, and decodes them in its
continuous batch; it also takes whole requests and prefills them itself: every request in colocated
mode (`submit`), and in disaggregated mode those the router sends past the prefill workers
(`prefill_locally`: short prompts, or prompts its prefix cache mostly holds).

An async Ray actor body (cluster/ wraps it with ray.remote); in unit tests a plain object.
Control methods are async and never touch the engine: they hand commands to the EngineLoop
thread. Tokens leave in one TokenBatchMsg per router per `poll`, never one message per token.
Routers reach the per-request methods and the token batches over the request channel
(protocol/channel.py, `channel_address`): it calls the same methods, and pushes what `poll`
would answer as soon as a step has rows; Ray calls reach them too.

Lease states:  reserved --kv_incoming--> receiving --KV arrived--> (a running request)
                   \\--expired/aborted/refused/failed--> freed     \\--timeout/aborted--> freed

Failures: the prefill worker answers the router before its push, so this worker is the one that
tells the router a push did not land: a KvReady it refuses or that says the push failed, a transfer
that fails or misses its deadline (which also drops the pair without waiting on the peer; the
prefill side re-forms it next time) and a lease that expires unclaimed each free the lease and put
an error row on the request's token stream; the router moves the request on. If the engine loop
dies, every request here is failed to its router at once, which moves them to another worker.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
from pydantic import Field

from engine import EngineCore, StepOutput
from engine.kv_cache import hash_full_blocks
from engine.loop import EngineLoop
from engine.parallel import RankStarter
from engine.parallel.local import LocalRanks
from engine.validation import InvalidRequestError
from kvtransfer.ranked import RankedKv, RankTable, model_layout
from kvtransfer import KvLayout, TransferHandle, create_transport, scatter_blocks
from kvtransfer import transport_options as kv_transport_options
from protocol.api import WorkerStatsMsg
from protocol.channel import Call, ChannelAddress, ChannelServer
from kvtransfer.endpoint import EndpointConfig, TransferEndpoint, wait_transfer
from kvtransfer.netaddr import resolve_host
from protocol.messages import (
    DraftKvOffer,
    GenerateRequestMsg,
    KvAcceptMsg,
    KvReadyMsg,
    LeaseMsg,
    LocalPrefillMsg,
    LocalPrefillReplyMsg,
    ReserveMsg,
    TokenBatchMsg,
    TokenOutputMsg,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


class DecodeWorkerConfig(EndpointConfig):
    lease_ttl_s: float = Field(30.0, gt=0, description="A lease whose KV has not started arriving by then is freed.")


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"


@dataclass
class Lease:
    lease_id: str
    request_id: str
    router_id: str
    block_ids: list[int]
    expires_at: float
    state: LeaseState = LeaseState.RESERVED
    is_aborted: bool = False


@dataclass
class Outbox:
    """Updates waiting for one router's next poll."""

    outputs: list[TokenOutputMsg] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class DecodeWorker(TransferEndpoint):
    def __init__(self, config: DecodeWorkerConfig, transport_options: dict[str, Any] | None = None,
                 start_ranks: RankStarter = LocalRanks, engine: EngineCore | None = None) -> None:
        """start_ranks: how the other ranks of a tensor-parallel worker start (Ray actors in a cluster).
        engine: one already built (a worker changing role keeps its weights, cache and ranks)."""
        self.config = config
        self.computes_every = False  # computes_every_prompt: no prefill pool, whole requests come here
        self.worker_id = config.worker_id
        engine = engine if engine is not None else EngineCore(config.engine, start_ranks=start_ranks)
        engine.itl_budget_ms = config.engine.scheduler.itl_budget_ms  # NOTE: a kept engine may have had it off
        self.block_size = engine.pool.block_size
        self.layout = model_layout(engine.runner.kv_caches, engine.arch.num_kv_heads, engine.kv_scales)
        draft = engine.draft_kv  # a draft model's cache: a prefill worker may send a prompt's KV for it
        self.draft_layout, self.draft_fingerprint = (KvLayout.from_kv(draft[0]), draft[1]) if draft else (None, None)
        host = resolve_host(config.host)
        options = kv_transport_options(config.transport, host, transport_options)
        self.transport = create_transport(config.transport, self.worker_id, self.layout, engine.device, **options)
        # Every rank's share of each receive (kvtransfer/ranked.py); with TP=1 this transport alone.
        self.kv = RankedKv(self.worker_id, self.transport, engine.runner.kv_caches, engine.arch.num_kv_heads,
                           engine.tp.group if engine.tp is not None else None, config.transport, options,
                           config.pair_timeout_s)
        self.num_draft_kv_adopted = 0  # prompts whose draft KV came from the prefill worker (engine thread writes)
        self.is_draining = False  # retiring: no new leases or requests; what runs finishes
        self.num_requests = 0  # requests that joined this worker's batch, since start
        self.leases: dict[str, Lease] = {}
        self.lease_of_request: dict[str, str] = {}
        self.router_of_request: dict[str, str] = {}  # requests in the engine -> who polls their tokens
        self.outboxes: dict[str, Outbox] = {}
        # prefill worker -> how many times a pair with it was formed: a failed transfer drops the pair
        # only if it is still the one the transfer ran on (never a pair re-formed in the meantime).
        self._pair_epochs: dict[str, int] = {}
        self._lease_ids = itertools.count()
        # Posts receives in the order KvReady messages were accepted (kv_incoming says why not there).
        self._receive_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.worker_id}-receives")
        self._aio: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.loop = EngineLoop(engine, self._on_outputs, self._on_engine_error, name=f"{self.worker_id}-engine")
        # The routers' request channel (protocol/channel.py), listening from the first channel_address call.
        self.channel = ChannelServer({
            Call.SUBMIT: self.submit, Call.PREFILL_LOCALLY: self.prefill_locally,
            Call.RESERVE: self.reserve, Call.ABORT: self.abort,
        }, self.poll, host)
        self.loop.start(freeze_gc=config.freeze_gc)

    # ---- plumbing
    def _bind(self) -> None:
        """Remembers the actor's event loop (engine outputs are handed to it) and starts the lease reaper."""
        if self._aio is None:
            self._aio = asyncio.get_running_loop()
            self._reaper = self._aio.create_task(self._reap_expired_leases())

    def _on_outputs(self, outputs: list[StepOutput]) -> None:  # engine thread
        """One wake-up of the event loop a step, handing it the engine's list as is (the engine makes
        a new one every step). The rows are made there, once, for the requests still followed."""
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self._deliver_step, outputs)

    def _on_engine_error(self, err: BaseException) -> None:  # engine thread
        self._error = err
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._fail_all, err)

    def _fail_all(self, err: BaseException) -> None:  # event loop
        """The engine is gone: every request here ends with an error its router can act on."""
        error = f"decode worker {self.worker_id} failed: {err}"
        self._deliver([TokenOutputMsg(request_id=r, new_token_ids=[], finish_reason="abort", error=error)
                       for r in list(self.router_of_request)])

    def _deliver_step(self, outputs: list[StepOutput]) -> None:  # event loop
        """A step's outputs as rows (the hot path: about 256 a step on a busy worker)."""
        new_row = tuple.__new__  # NOTE: TokenOutputMsg(...) less its Python-level __new__ (a third of a row's cost)
        self._deliver([new_row(TokenOutputMsg, (
            out.request_id, out.new_token_ids, out.logprobs, out.top_logprobs, out.finish_reason,
            out.num_prompt_tokens, out.num_cached_tokens, None,
        )) for out in outputs])

    def _deliver(self, outputs: list[TokenOutputMsg]) -> None:  # event loop
        """Rows into their routers' outboxes, each outbox's poller woken once; rows of requests no
        longer followed (aborted meanwhile) are dropped."""
        router_of_request = self.router_of_request
        rows_of: dict[str, list[TokenOutputMsg]] = {}  # router -> its outbox's rows
        for out in outputs:
            router_id = router_of_request.get(out.request_id)
            if router_id is None:
                continue  # aborted in the meantime
            if out.finish_reason is not None:
                del router_of_request[out.request_id]
            rows = rows_of.get(router_id)
            if rows is None:
                rows = rows_of[router_id] = self._outbox(router_id).outputs
            rows.append(out)
        for router_id in rows_of:
            self.outboxes[router_id].ready.set()

    def _outbox(self, router_id: str) -> Outbox:
        box = self.outboxes.get(router_id)
        if box is None:
            box = self.outboxes[router_id] = Outbox()
        return box

    # ---- control: whole requests (prefilled here)
    async def submit(self, request: bytes) -> float:
        """Colocated mode: prefill and decode a whole request here. Returns when the call arrived, on
        this host's clock (time.perf_counter), as the prefill worker's answer does (arrived_at)."""
        arrived = time.perf_counter()
        self._bind()
        if self.is_draining:
            raise RuntimeError(f"decode worker {self.worker_id} is draining: send the request to another worker")
        msg = GenerateRequestMsg.decode(request)
        await self._admit(msg, lambda e: e.add_request(
            msg.request_id, msg.prompt_token_ids, msg.params, num_prior_output_tokens=msg.num_prior_output_tokens
        ))
        self.num_requests += 1
        return arrived

    async def prefill_locally(self, local: bytes) -> bytes:
        """Disaggregated mode, a request that skips the prefill workers: computes its prompt here
        (prefix-cache hits reused, chunked into the running batch like any prompt) and decodes it,
        as `submit` does. Answers a LocalPrefillReplyMsg; declined (nothing changed, the router
        goes through a prefill worker) when draining, when the prompt's blocks cannot be had now,
        or when the prefix cache holds fewer than `min_cached_tokens` of it."""
        self._bind()
        msg = LocalPrefillMsg.decode(local)
        request = msg.request
        if self.is_draining:
            return LocalPrefillReplyMsg(accepted=False, reason=f"decode worker {self.worker_id} is draining").encode()
        if request.request_id in self.lease_of_request or request.request_id in self.router_of_request:
            raise ValueError(f"request {request.request_id!r} already has a lease or runs here")

        def admit(engine: EngineCore) -> LocalPrefillReplyMsg:
            reply = _local_admission(engine, request.prompt_token_ids, msg.min_cached_tokens)
            if reply.accepted:
                engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                   num_prior_output_tokens=request.num_prior_output_tokens)
            return reply

        reply = await self._admit(request, admit)
        if reply.accepted:
            self.num_requests += 1
        else:
            self.router_of_request.pop(request.request_id, None)
        return reply.encode()

    async def _admit(self, msg: GenerateRequestMsg, admit: Callable[[EngineCore], T]) -> T:
        """Runs `admit` (which queues the request in the engine, or declines) on the engine thread.
        NOTE: the request's router is known first, so its first tokens find their outbox."""
        self.router_of_request[msg.request_id] = msg.router_id
        try:
            if msg.params.grammar is not None:
                await asyncio.to_thread(self.loop.prepare, msg.params)
            return await self._call(admit)
        except Exception:
            self.router_of_request.pop(msg.request_id, None)
            raise

    # ---- control: the lease protocol
    async def reserve(self, request: bytes) -> bytes | None:
        """A lease on enough blocks for the prompt and its first decode step, or None when full."""
        self._bind()
        if self.is_draining:
            return None  # the router leases elsewhere
        msg = ReserveMsg.decode(request)
        if msg.request_id in self.lease_of_request or msg.request_id in self.router_of_request:
            raise ValueError(f"request {msg.request_id!r} already has a lease or runs here")
        lease_id = f"{self.worker_id}/{next(self._lease_ids)}"
        num_blocks = -(-(msg.num_prompt_tokens + 1) // self.block_size)
        blocks = await self._call(lambda e: e.reserve(lease_id, num_blocks))
        if blocks is None:
            return None
        lease = Lease(lease_id, msg.request_id, msg.router_id, blocks, time.time() + self.config.lease_ttl_s)
        self.leases[lease_id] = lease
        self.lease_of_request[msg.request_id] = lease_id
        return LeaseMsg(
            lease_id=lease_id, decode_worker_id=self.worker_id, block_ids=blocks, expires_at=lease.expires_at
        ).encode()

    async def transport_address(self) -> list[Any]:
        """Where each rank of this worker hosts its pairs (a RankTable, on the wire)."""
        return self.kv.table.to_wire()

    async def accept_pair(self, prefill_worker_id: str, prefill: list[Any]) -> None:
        """The decode side (rank 0, hosting the store) of forming a pair; the prefill side calls
        `pair` at the same time. A stale pair with the same peer is dropped first.
        NOTE: the epoch moves on before the drop: a transfer of the stale pair that fails while the
        new one forms (the drop fails it) must not drop the new pair."""
        self._pair_epochs[prefill_worker_id] = self._pair_epochs.get(prefill_worker_id, 0) + 1
        self.kv.drop(prefill_worker_id)
        await self.kv.pair_async(RankTable.from_wire(prefill), False, self.config.pair_timeout_s)

    async def kv_incoming(self, ready: bytes) -> bytes:
        """Accepts a lease's KV and returns at once: its receives are posted on the receive thread
        (`_post_receives`) and the KV lands in the background.

        NOTE: the answer touches no CUDA. A posted NCCL receive spins on the GPU until its sender
        sends, and the sender sends only once it has this answer; meanwhile a CUDA call of this
        process may wait for the GPU, and the answer would never leave (seen on 2x H200). So the
        answer goes first and the receives are posted after, in the order the answers went (one
        thread), which is the order the prefill worker sends."""
        self._bind()
        msg = KvReadyMsg.decode(ready)
        lease = self.leases.get(msg.lease_id)
        reason = msg.failure or _refusal(lease, msg)
        if reason:
            await self._refused(lease, msg, reason)
            return KvAcceptMsg(accepted=False, reason=reason).encode()
        assert lease is not None
        if not self.kv.is_paired(msg.prefill_worker_id):  # a failed transfer dropped the pair
            reason = f"{self.worker_id!r} is not paired with {msg.prefill_worker_id!r}"
            await self._refused(lease, msg, reason)
            return KvAcceptMsg(accepted=False, reason=reason, is_unpaired=True).encode()
        epoch = self._pair_epochs.get(msg.prefill_worker_id, 0)
        takes_draft = self._takes_draft(msg.draft)
        posted = self._receive_thread.submit(self._post_receives, msg, takes_draft)
        lease.state = LeaseState.RECEIVING
        self._aio.create_task(self._land(msg, lease, asyncio.wrap_future(posted), epoch))  # type: ignore[union-attr]
        return KvAcceptMsg(accepted=True, draft=takes_draft).encode()

    async def _refused(self, lease: Lease | None, msg: KvReadyMsg, reason: str) -> None:
        """A KvReady refused (or failed, KvReadyMsg.failure) for its own, still reserved lease: the
        lease is freed and the request's router hears it on the token stream (the prefill worker
        answered before its push and never tells it; an error row means nothing is held here). Not for
        a lease the router aborted, one already receiving (that receive goes on) or another request's."""
        if (lease is not None and not lease.is_aborted and lease.state == LeaseState.RESERVED
                and lease.request_id == msg.request.request_id):
            await self._drop_lease(lease)
            error = msg.failure or f"decode worker refused the KV: {reason}"
            self._deliver_error(lease.request_id, lease.router_id, error)

    def _post_receives(self, msg: KvReadyMsg, takes_draft: bool) -> _Receives:  # the receive thread
        """The receives of one KvReady, in the order its sender sends: the KV, then the draft's KV."""
        device = self.loop.engine.device
        peer = msg.prefill_worker_id
        handles = [self.kv.recv(peer, msg.lease_id, msg.num_blocks)]  # every rank's heads, kept under the lease id
        draft = None
        if takes_draft:
            assert self.draft_layout is not None
            shape = self.draft_layout.buffer_shape(msg.num_blocks)
            draft = torch.empty(shape, dtype=self.draft_layout.torch_dtype, device=device)
            handles.append(self.transport.recv(peer, draft))
        return _Receives(draft, handles)

    def _takes_draft(self, offer: DraftKvOffer | None) -> bool:
        """Whether a draft's KV offered with a prompt is for this worker's draft (same layout and
        weights); otherwise this worker's draft computes the prompt itself."""
        if offer is None or self.draft_layout is None or self.kv.tp > 1:
            return False
        try:
            same_layout = KvLayout.from_ints(offer.layout) == self.draft_layout
        except ValueError:
            same_layout = False
        return same_layout and offer.fingerprint == self.draft_fingerprint

    async def _land(self, msg: KvReadyMsg, lease: Lease, posted: asyncio.Future[_Receives], epoch: int) -> None:
        """Waits for the receives to be posted, then for the KV (and the draft's KV if it comes),
        then scatters it into the lease's blocks and joins the request; a failure frees the lease
        and tells the router."""
        failure = None
        request = msg.request
        # NOTE: a grammar compiles (a cache hit, mostly) while the KV arrives, off the engine thread.
        prepared = asyncio.ensure_future(asyncio.to_thread(self.loop.prepare, request.params)) \
            if request.params.grammar is not None else None
        try:
            receives: _Receives | None = await posted
        except ValueError as err:  # not paired any more (a failed transfer dropped the pair meanwhile)
            receives, failure = None, f"failed: {err}"
        for handle in receives.handles if receives is not None else []:
            failure = failure or await wait_transfer(handle, self.config.transfer_timeout_s)
        refused = None
        if prepared is not None:
            try:
                await prepared
            except InvalidRequestError as err:  # NOTE: the router compiled it: only a changed cache gets here
                refused = str(err)
        if refused is not None and failure is None and not lease.is_aborted:
            await self._drop_lease(lease)
            self.kv.forget(lease.lease_id)
            self._deliver_error(request.request_id, lease.router_id, refused)
            return
        if failure is not None or lease.is_aborted:
            await self._drop_lease(lease)
            self.kv.forget(lease.lease_id)
            if failure is not None and self._pair_epochs.get(msg.prefill_worker_id, 0) == epoch:
                self.kv.drop(msg.prefill_worker_id)  # never waits on a dead peer; re-pairs later
            if not lease.is_aborted:
                self._deliver_error(request.request_id, lease.router_id, f"KV transfer {failure}")
            return

        assert receives is not None
        draft, first_token = receives.draft, msg.first_token

        def join(engine: EngineCore) -> None:
            self.kv.scatter(lease.lease_id, lease.block_ids[: msg.num_blocks])
            engine.add_prefilled(
                request.request_id, request.prompt_token_ids, first_token, request.params,
                lease.lease_id, request.num_prior_output_tokens,
            )
            adopted = engine.adopt_draft_prompt(request.request_id) if draft is not None else None
            if adopted is not None:  # NOTE: None: no room in the draft's pool; its first step computes the prompt
                assert draft is not None
                scatter_blocks(adopted[0], adopted[1], draft)
                self.num_draft_kv_adopted += 1

        self.router_of_request[request.request_id] = lease.router_id
        self.num_requests += 1
        self._forget_lease(lease)
        try:
            await self._call(join)
        except Exception as err:  # noqa: BLE001 - reported to the router, the lease freed
            self.router_of_request.pop(request.request_id, None)
            await self._call(lambda e: e.release_held(lease.lease_id))
            self._deliver_error(request.request_id, lease.router_id, f"decode worker refused the request: {err}")

    def _deliver_error(self, request_id: str, router_id: str, error: str) -> None:
        self.router_of_request[request_id] = router_id
        self._deliver([TokenOutputMsg(request_id=request_id, new_token_ids=[], finish_reason="abort", error=error)])

    # ---- control: everything else
    async def channel_address(self) -> ChannelAddress:
        """Where routers open the request channel (its calls and pushed token batches go there
        instead of through Ray): (host, port, secret)."""
        self._bind()
        return await self.channel.address()

    async def poll(self, router_id: str, timeout_s: float = 1.0) -> bytes:
        """Everything new for `router_id` since its last poll; waits up to `timeout_s` for something."""
        self._bind()
        box = self._outbox(router_id)
        if not box.outputs:
            # NOTE: the deadline sets `ready` too, and is cancelled before it is cleared below. Cheaper than
            # asyncio.wait_for, which runs the wait as a task of its own: this is once a step per router.
            deadline = self._aio.call_later(timeout_s, box.ready.set)  # type: ignore[union-attr]
            try:
                await box.ready.wait()
            finally:
                deadline.cancel()
        outputs, box.outputs = box.outputs, []
        box.ready.clear()
        return TokenBatchMsg(worker_id=self.worker_id, outputs=outputs, sent_at=time.perf_counter()).encode()

    async def abort(self, request_id: str) -> bool:
        """Idempotent: frees whatever the request holds here (a lease, or its running blocks)."""
        self._bind()
        lease_id = self.lease_of_request.get(request_id)
        if lease_id is not None:
            lease = self.leases[lease_id]
            lease.is_aborted = True
            if lease.state == LeaseState.RESERVED:
                await self._drop_lease(lease)
            return True
        self.router_of_request.pop(request_id, None)
        return await self._call(lambda e: e.abort_request(request_id))

    async def _drop_lease(self, lease: Lease) -> None:
        self._forget_lease(lease)
        await self._call(lambda e: e.release_held(lease.lease_id))

    def _forget_lease(self, lease: Lease) -> None:
        self.leases.pop(lease.lease_id, None)
        self.lease_of_request.pop(lease.request_id, None)

    async def _reap_expired_leases(self, interval_s: float = 0.25) -> None:
        while True:
            await asyncio.sleep(interval_s)
            now = time.time()
            for lease in [x for x in self.leases.values() if x.state == LeaseState.RESERVED and x.expires_at < now]:
                log.info("lease %s of request %s expired unclaimed", lease.lease_id, lease.request_id)
                await self._drop_lease(lease)
                # NOTE: its router may wait for it here (its prefill worker answered before the push)
                self._deliver_error(lease.request_id, lease.router_id, f"lease {lease.lease_id} expired: no KV came "
                                    f"within lease_ttl_s ({self.config.lease_ttl_s} s)")

    async def drain(self) -> None:
        """Retiring: from now on no new lease or request is taken; running ones finish and their
        tokens are still polled. Idempotent."""
        self.is_draining = True

    async def computes_every_prompt(self, every: bool) -> None:
        """True while the deployment has no prefill worker (its pool shrank to none): the routers send this
        worker whole requests, as to a colocated one, and its steps drop the inter-token latency budget
        (which keeps a disaggregated decode worker's own prefills from slowing the batch it decodes, but
        starved colocated workers' prompts: deploy/cli.py says what it cost); False restores it."""
        budget_ms = None if every else self.config.engine.scheduler.itl_budget_ms

        def apply(engine: EngineCore) -> None:
            engine.itl_budget_ms = budget_ms

        await self._call(apply)
        self.computes_every = every

    async def stats(self) -> WorkerStatsMsg:
        s = await self._call(lambda e: self.loop.stats())
        return WorkerStatsMsg(
            worker_id=self.worker_id, role="decode", pid=os.getpid(), is_healthy=await self.health(), **s.load(),
            num_channels=self.channel.num_connections,
            num_leases=len(self.leases), num_undelivered=sum(len(box.outputs) for box in self.outboxes.values()),
            is_draining=self.is_draining, num_draft_kv_adopted=self.num_draft_kv_adopted,
            num_requests=self.num_requests,
            computes_every_prompt=self.computes_every,
        )

    async def shutdown(self, keep_engine: bool = False) -> None:
        """keep_engine: leave the engine (and its ranks) for the role that follows."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self.channel.close()
        self.loop.stop()
        if not self.loop.is_alive and not keep_engine:
            self.loop.engine.close()  # the other ranks of a tensor-parallel worker
        self._receive_thread.shutdown(wait=False)
        self.kv.close()
        self.transport.close()


def _local_admission(engine: EngineCore, prompt: list[int], min_cached_tokens: int) -> LocalPrefillReplyMsg:
    """Ask, then act: whether a prompt may be prefilled here now. Room means blocks for the whole
    prompt and its first token (as a lease would take) beyond what the waiting requests will take;
    cached prefix blocks are not subtracted (an idle one counts as free already)."""
    pool = engine.pool
    block_size = pool.block_size
    max_hit_blocks = (len(prompt) - 1) // block_size  # the last token is always computed
    hits = pool.find_cached_prefix(hash_full_blocks(prompt, block_size, [])[:max_hit_blocks])
    num_cached = len(hits) * block_size
    if num_cached < min_cached_tokens:
        return LocalPrefillReplyMsg(
            accepted=False, reason=f"{num_cached} prompt tokens cached here, fewer than {min_cached_tokens}",
            num_cached_tokens=num_cached,
        )
    num_waiting_blocks = sum(-(-(r.num_tokens + 1) // block_size) for r in engine.scheduler.waiting)
    num_blocks = -(-(len(prompt) + 1) // block_size)
    if not pool.can_allocate(num_blocks + num_waiting_blocks):
        return LocalPrefillReplyMsg(
            accepted=False, num_cached_tokens=num_cached,
            reason=f"{num_blocks} KV blocks for the prompt cannot be had ({pool.num_free_blocks} free, "
            f"{num_waiting_blocks} wanted by waiting requests)",
        )
    return LocalPrefillReplyMsg(accepted=True, num_cached_tokens=num_cached)


def _refusal(lease: Lease | None, msg: KvReadyMsg) -> str:
    if lease is None:
        return f"lease {msg.lease_id!r} is unknown here: it expired or was aborted"
    if lease.is_aborted:
        return f"request {lease.request_id!r} was aborted"
    if lease.state != LeaseState.RESERVED:
        return f"lease {msg.lease_id!r} is already receiving"
    if lease.request_id != msg.request.request_id:
        return f"lease {msg.lease_id!r} belongs to request {lease.request_id!r}"
    if msg.num_blocks > len(lease.block_ids):
        return f"{msg.num_blocks} blocks do not fit a lease of {len(lease.block_ids)}"
    return ""


class _Receives(NamedTuple):
    """One KvReady's receives, posted (decode worker's receive thread), in the order they are sent."""

    draft: torch.Tensor | None  # the draft's KV of the prompt, when accepted
    handles: list[TransferHandle]


__all__ = ["DecodeWorker", "DecodeWorkerConfig", "Lease", "LeaseState"]
