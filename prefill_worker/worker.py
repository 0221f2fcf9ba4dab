"""PrefillWorker: computes prompts (batched under a token budget, chunked, prefix-cache hits reused),
samples each first token, and pushes the prompt's KV into the blocks a decode worker leased.

An async Ray actor body (cluster/ wraps it with ray.remote); in unit tests a plain object. Its
blocks for a request stay held from the prefill until the push ends (sent, refused, failed or
aborted), then go to the prefix cache. Transfers on one pair run one at a time, so receives are
posted in the order sends are.

Routers reach `prefill`, `attach_lease` and `abort` over the request channel (kvtransfer/channel.py,
`channel_address`) instead of Ray calls; it calls the same methods.

The answer (the first token) goes before the push when the decode worker can report the push's
failure itself (answer_before_push: the lease attached and the pair formed, or an early handshake
accepted); the push then runs in the background, holding the request's state and blocks here until
it ends (its figures in push_records and stats).

Failures: a push that fails or misses its deadline drops the pair (never waiting on the peer; the
next push re-forms it). Answered after the push, the answer carries the error; answered before it,
the decode worker tells the router (a receive that fails or times out, a KvReady it refuses, a
lease that expires). Either way the router retries the request elsewhere. Bad input raises
InvalidRequestError (the router answers 4xx and retries nothing).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engine import EngineCore, SpeculativeConfig, StepOutput
from engine.engine import resolve_device, resolve_dtype, resolve_model_dir
from engine.loop import EngineLoop
from engine.models import load_arch
from engine.pinned import upload
from engine.spec.draft_prefill import DraftPrefiller, split_to_fit
from engine.validation import InvalidRequestError
from kvtransfer import KvLayout, PairAddress, TransferHandle, create_transport, gather_blocks
from kvtransfer import transport_options as kv_transport_options
from kvtransfer.channel import Call, ChannelAddress, ChannelServer, Refs
from kvtransfer.endpoint import TransferEndpoint, wait_transfer
from kvtransfer.layout import layer_groups
from kvtransfer.netaddr import resolve_host
from kvtransfer.protocol import DraftKvOffer, KvAcceptMsg, KvReadyMsg, LeaseMsg, PrefillResultMsg, PrefillTaskMsg
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.layer_push import LayerPush, Streamed
from prefill_worker.pushes import Early, Gathered, PushLog, has_result

log = logging.getLogger(__name__)

_DraftJob = tuple[list[int], "asyncio.Future[torch.Tensor]"]  # a prompt, and where its draft KV goes

# Ended prefills remembered (a lease attached after its prefill's answer is refused; one attached
# before its prefill call waits for it).
_NUM_ENDED_KEPT = 4096


class PrefillWorker(TransferEndpoint):
    def __init__(self, config: PrefillWorkerConfig, transport_options: dict[str, Any] | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id
        spec = config.engine.speculative
        # NOTE: built before the engine, which sizes its KV cache from the memory left.
        self.draft = _draft_prefiller(config) if config.ship_draft_kv and spec.method == "draft" else None
        # A prefill worker never drafts: its engine runs without a proposer (and its memory).
        engine = EngineCore(config.engine.model_copy(update={"speculative": SpeculativeConfig()}))
        self.block_size = engine.pool.block_size
        self.max_seq_tokens = engine.max_seq_tokens
        host = resolve_host(config.host)
        self.transport = create_transport(
            config.transport, self.worker_id, KvLayout.from_kv(engine.runner.kv_caches), engine.device,
            **kv_transport_options(config.transport, host, transport_options),
        )
        # The routers' request channel (kvtransfer/channel.py), listening from the first channel_address call;
        # the decode worker a call names comes as a reference (its pickled actor handle), loaded by self.refs.
        self.refs = Refs()
        self.channel = ChannelServer({
            Call.PREFILL: lambda task, ref: self.prefill(task, self.refs.decode(ref)),
            Call.ATTACH_LEASE: lambda rid, lease, ref: self.attach_lease(rid, lease, self.refs.decode(ref)),
            Call.ABORT: self.abort,
        }, None, host)
        self._first_tokens: dict[str, asyncio.Future[StepOutput]] = {}
        self._gathered: dict[str, Gathered] = {}  # request -> its KV gathered when its prefill ended
        # request -> its prompt, for the draft's prefill after the target's (self.draft; prompts that fit it)
        self._draft_prompts: dict[str, list[int]] = {}
        # request -> its draft KV in one buffer (on self.draft's stream), once computed
        self._draft_kv: dict[str, asyncio.Future[torch.Tensor]] = {}
        self.draft_layout = None if self.draft is None else KvLayout.from_kv(self.draft.kv_caches)
        self.draft_offer = None if self.draft is None or self.draft_layout is None else DraftKvOffer(
            layout=self.draft_layout.to_ints().tolist(), fingerprint=self.draft.fingerprint
        )
        # request -> (its lease, the decode worker's handle): given with the task, or attached later
        self._leases: dict[str, asyncio.Future[tuple[LeaseMsg, Any]]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # the latest requests whose prefill ended here
        self._live: set[str] = set()  # requests inside `prefill`
        self._aborted: set[str] = set()  # those of them aborted (their push must not start)
        self._pair_locks: dict[str, asyncio.Lock] = {}
        # decode worker -> how many times a pair with it was formed: a failed push drops the pair only
        # if it is still the one the push ran on (never a pair another push re-formed meanwhile).
        self._pair_epochs: dict[str, int] = {}
        self._aio: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        # request -> its push, under way after the answer (answer_before_push); it holds the prompt's
        # blocks and the request's state here until it ends (_push_ended).
        self._pushing: dict[str, asyncio.Task[PrefillResultMsg]] = {}
        self.push_log = PushLog()
        self.layer_push = LayerPush(self.transport, engine.runner.kv_caches, self._defer)
        engine.layer_hook = self.layer_push.hook
        self.loop = EngineLoop(engine, self._on_outputs, self._on_engine_error, name=f"{self.worker_id}-engine")
        self.loop.start()

    # ---- plumbing
    def _defer(self, fn: Callable[[], None]) -> None:  # engine thread
        if self._aio is not None:
            self._aio.call_soon_threadsafe(fn)
        else:
            fn()

    def _num_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt's KV fills, the ones its push moves."""
        return -(-num_prompt_tokens // self.block_size)

    def _on_outputs(self, outputs: list[StepOutput]) -> None:  # engine thread
        assert self._aio is not None
        gathered: dict[str, Gathered] = {}
        for out in outputs:
            # The prompt's KV into one buffer now, queued right behind the step that computed it,
            # rather than in a command the engine thread runs later.
            if (out.kv_block_ids and out.finish_reason != "abort" and out.request_id in self._live
                    and not self.layer_push.is_claimed(out.request_id)):  # NOTE: a claimed one's KV went already
                gathered[out.request_id] = self._gather(out)
        # NOTE: taken before the answers can go (after them, `prefill` forgets these requests' drafts)
        drafts = [(prompt, future) for out in outputs
                  if out.kv_block_ids and out.finish_reason != "abort"
                  and (prompt := self._draft_prompts.get(out.request_id)) is not None
                  and (future := self._draft_kv.get(out.request_id)) is not None]
        self._aio.call_soon_threadsafe(self._resolve, outputs, gathered)
        if drafts:
            self._prefill_drafts(drafts)  # NOTE: after the first tokens are on their way

    def _prefill_drafts(self, drafts: list[_DraftJob]) -> None:  # engine thread
        """The draft's KV of the prompts this step finished, each in one buffer (queued on the
        draft's stream, beside the next target step), into their futures on the event loop."""
        assert self.draft is not None and self._aio is not None
        draft = self.draft
        prompts = [prompt for prompt, _ in drafts]
        buffers: list[torch.Tensor | BaseException] = []
        try:
            with draft.stream_context():
                for group in split_to_fit(prompts, draft.num_blocks, draft.block_size):
                    blocks = draft.prefill([prompts[i] for i in group])
                    buffers += [gather_blocks(draft.kv_caches, block_ids) for block_ids in blocks]
        except Exception as err:  # noqa: BLE001 - those requests' decode workers get a stand-in
            log.error("draft prefill failed: %s", err)
            buffers = [err] * len(drafts)
        self._aio.call_soon_threadsafe(_resolve_drafts, [future for _, future in drafts], buffers)

    def _gather(self, out: StepOutput) -> Gathered:  # engine thread
        assert out.kv_block_ids is not None
        kv = self.loop.engine.runner.kv_caches
        blocks = out.kv_block_ids[: self._num_blocks(out.num_prompt_tokens)]
        if not kv.is_cuda:
            return Gathered(gather_blocks(kv, blocks), None, None)
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        buf = gather_blocks(kv, blocks)
        ended.record()
        return Gathered(buf, started, ended)

    def _on_engine_error(self, err: BaseException) -> None:  # engine thread
        self._error = err
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._fail_all, err)

    def _resolve(self, outputs: list[StepOutput], gathered: dict[str, Gathered]) -> None:
        for out in outputs:
            future = self._first_tokens.pop(out.request_id, None)
            if future is not None and not future.done():
                if out.request_id in gathered:
                    self._gathered[out.request_id] = gathered[out.request_id]
                future.set_result(out)

    def _fail_all(self, err: BaseException) -> None:
        for future in self._first_tokens.values():
            if not future.done():
                future.set_exception(RuntimeError(f"prefill worker {self.worker_id} failed: {err}"))

    # ---- the protocol
    async def prefill(self, task: bytes, decode_worker: Any = None) -> bytes:
        """Computes the prompt, pushes its KV to `decode_worker` (an actor handle, or the worker
        itself in-process) and answers with the first token. A task without a lease (and no
        decode_worker) computes at once and pushes once `attach_lease` has said where."""
        self._aio = asyncio.get_running_loop()
        arrived = time.perf_counter()
        msg = PrefillTaskMsg.decode(task)
        rid = msg.request.request_id
        future: asyncio.Future[StepOutput] = self._aio.create_future()
        self._first_tokens[rid] = future
        self._live.add(rid)
        self._ended.pop(rid, None)  # NOTE: a prefill stopped for want of room comes again with its lease
        lease = self._leases.setdefault(rid, self._aio.create_future())
        if msg.lease is not None and not lease.done():
            lease.set_result((msg.lease, decode_worker))
        if self.draft is not None and self.draft.fits(len(msg.request.prompt_token_ids)):
            self._draft_kv[rid] = self._aio.create_future()
            self._draft_prompts[rid] = msg.request.prompt_token_ids  # NOTE: last: the engine thread reads it
        try:
            result = await self._prefill(msg, future)
            answered = time.perf_counter()
            update = {"worker_s": answered - arrived, "arrived_at": arrived, "answered_at": answered}
            return result.model_copy(update=update).encode()
        finally:
            if rid not in self._pushing:  # NOTE: a push under way after the answer forgets it when it ends
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        """A request's prefill and push have ended here: its state goes (its name stays in _ended)."""
        self._live.discard(rid)
        self._aborted.discard(rid)
        self._gathered.pop(rid, None)
        self._leases.pop(rid, None)
        self._draft_prompts.pop(rid, None)
        self._draft_kv.pop(rid, None)  # NOTE: a draft send under way holds the future itself
        self._ended[rid] = None
        while len(self._ended) > _NUM_ENDED_KEPT:
            self._ended.popitem(last=False)
        # NOTE: its layer push (if offered) is closed by whichever of _push and _settle sends the rest

    async def attach_lease(self, request_id: str, lease: bytes, decode_worker: Any) -> bool:
        """The lease of a prefill that started without one (the router reserves it meanwhile):
        where to push. False when that prefill has ended here (its answer says how).
        NOTE: an async actor runs calls in any order: this one may come before its `prefill` call,
        which then finds the lease waiting."""
        if request_id not in self._live:
            if request_id in self._ended:
                return False
            self._leases.setdefault(request_id, asyncio.get_running_loop().create_future())
        future = self._leases[request_id]
        if future.done():
            return False
        future.set_result((LeaseMsg.decode(lease), decode_worker))
        return True

    async def _lease(self, request_id: str) -> tuple[LeaseMsg, Any]:
        """The request's lease and decode worker, once the router has attached them."""
        future = self._leases[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.config.pair_timeout_s)
        except TimeoutError:
            if future.done():
                raise  # the abort's own TimeoutError, which says so
            raise TimeoutError(f"no lease came for {request_id!r} within {self.config.pair_timeout_s} s") from None

    async def _prefill(self, msg: PrefillTaskMsg, future: asyncio.Future[StepOutput]) -> PrefillResultMsg:
        request = msg.request
        rid = request.request_id
        params = request.params
        first_params = params.model_copy(update={"max_tokens": 1, "min_tokens": min(1, params.min_tokens)})
        started = time.perf_counter()
        early = self._early_handshake(msg) if self._wants_early_handshake(msg) else None
        try:
            await self._call(lambda e: e.add_request(
                rid, request.prompt_token_ids, first_params, hold_kv=True,
                num_prior_output_tokens=request.num_prior_output_tokens,
            ))
        except InvalidRequestError:
            self._first_tokens.pop(rid, None)
            self._settle(early, msg)
            raise  # the client's mistake: no other worker would take it either
        except Exception as err:
            self._first_tokens.pop(rid, None)
            self._settle(early, msg)
            return PrefillResultMsg(request_id=rid, error=str(err))
        except BaseException:  # cancelled: the early handshake must still be settled
            self._first_tokens.pop(rid, None)
            self._settle(early, msg)
            raise
        try:
            out = await future
        except BaseException:
            self._settle(early, msg)
            raise
        prefilled = time.perf_counter()
        if self.config.answer_before_push:
            answer = await self._answer_before_push(msg, out, early, prefilled)
            if answer is not None:
                return answer.model_copy(update={"prefill_s": prefilled - started})
        try:
            result = await self._push(msg, out, early)
            timing = {"prefill_s": prefilled - started, "push_s": time.perf_counter() - prefilled,
                      "push_marks_s": [t - prefilled for t in result.push_marks_s]}
            return result.model_copy(update=timing)
        finally:
            # NOTE: not awaited (the answer does not wait for the engine thread): later engine
            # commands (an integrity check, the next prompt's prefix lookup) queue behind it.
            self.loop.submit(lambda e: e.release_held(rid)).add_done_callback(_log_failure)

    async def _answer_before_push(
        self, msg: PrefillTaskMsg, out: StepOutput, early: asyncio.Task[Early | None] | None, prefilled: float
    ) -> PrefillResultMsg | None:
        """The answer with the first token, the push started in the background (answer_before_push),
        when the first token does not end the request and the decode worker will report a push that
        fails on its token stream: the early handshake was accepted (it holds the request), or there
        was none, the lease is attached and the pair formed (it holds the lease: a handshake it
        refuses, or one that never comes before the lease expires, it reports; a pair that fails to
        form, a layout mismatch, only the prefill worker knows). None: the caller pushes and answers
        after."""
        request = msg.request
        rid = request.request_id
        aborted, finish = self._ending(msg, out)
        if aborted or finish is not None:
            return None
        handshake = None
        if early is not None:
            try:
                handshake = await asyncio.shield(early)
            except BaseException:  # cancelled: the decode side still gets what it waits for
                self._settle(early, msg)
                raise
            if handshake is not None and handshake.decode_id is None:
                return None  # refused or failed: the push's answer says how
        if handshake is None:
            lease = self._leases.get(rid)
            if not has_result(lease):
                return None  # NOTE: no lease yet: the router may still stop this prefill for want of room
            assert lease is not None
            if not self.transport.is_paired(lease.result()[0].decode_worker_id):
                return None  # NOTE: pairing checks the layouts; its failure must reach the router in the answer
        push = asyncio.ensure_future(self._push(msg, out, early))
        self._pushing[rid] = push
        push.add_done_callback(lambda done: self._push_ended(rid, done, prefilled))
        layout = self.transport.layout
        num_blocks = self._num_blocks(len(request.prompt_token_ids))
        push_bytes = layout.torch_dtype.itemsize * math.prod(layout.buffer_shape(num_blocks))
        return PrefillResultMsg(**self._first_answer(request.request_id, out), push_bytes=push_bytes,
                                push_pending=True)

    def _push_ended(self, rid: str, done: asyncio.Task[PrefillResultMsg], prefilled: float) -> None:
        """A push after the answer has ended: its state and blocks go, its figures into push_log."""
        self._pushing.pop(rid, None)
        self._forget(rid)
        self.loop.submit(lambda e: e.release_held(rid)).add_done_callback(_log_failure)
        self.push_log.ended(rid, done, prefilled)

    async def settle_pushes(self, timeout_s: float | None = None) -> int:
        """Waits (at most timeout_s, default transfer_timeout_s) for the pushes under way after their
        answers; returns how many are still under way."""
        pushes = list(self._pushing.values())
        if pushes:
            await asyncio.wait(pushes, timeout=self.config.transfer_timeout_s if timeout_s is None else timeout_s)
        return len(self._pushing)

    async def push_records(self) -> list[bytes]:
        """The latest pushes that ended after their answer (answer_before_push), oldest first, each a
        PrefillResultMsg with the push's figures (push_s from the first token to the sends done)."""
        return [r.encode() for r in self.push_log.records]

    async def check_integrity(self) -> int:
        """As TransferEndpoint's, once the pushes under way have ended (they hold their prompts'
        blocks until then; bounded by transfer_timeout_s)."""
        await self.settle_pushes()
        return await super().check_integrity()

    def _ending(self, msg: PrefillTaskMsg, out: StepOutput) -> tuple[bool, str | None]:
        """Whether the request was aborted, and the finish reason if its first token ends it."""
        request = msg.request
        aborted = out.finish_reason == "abort" or request.request_id in self._aborted
        finish = None if aborted else self._finish_reason(out, len(request.prompt_token_ids), request.params.max_tokens)
        return aborted, finish

    @staticmethod
    def _first_answer(rid: str, out: StepOutput) -> dict[str, Any]:
        """The answer's fields that the prefill step gives (the first token and its counts)."""
        return dict(
            request_id=rid,
            first_token=out.new_token_ids[0] if out.new_token_ids else None,
            logprob=out.logprobs[0] if out.logprobs else None,
            top_logprobs=out.top_logprobs[0] if out.top_logprobs else None,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
        )

    # ---- the early handshake (PrefillWorkerConfig.early_handshake)
    def _wants_early_handshake(self, msg: PrefillTaskMsg) -> bool:
        """Only where it cannot hold up other pushes for long: the prompt is one engine step and
        nothing waits in the engine (a racy read, a heuristic); the pair must be free as well, which
        `_early_handshake` checks once the lease is known."""
        engine = self.loop.engine
        return (
            self.config.early_handshake
            and len(msg.request.prompt_token_ids) <= engine.config.scheduler.max_num_batched_tokens
            and not engine.scheduler.waiting
        )

    def _early_handshake(self, msg: PrefillTaskMsg) -> asyncio.Task[Early | None]:
        """Starts the handshake now, beside the prompt's computation: KvReady without the first token,
        as soon as the lease is known; once accepted, the KV's layer groups go as the step writes them
        (LayerPush). None: no early handshake (a push to that decode worker holds the pair, or no
        lease came)."""
        rid = msg.request.request_id
        num_blocks = self._num_blocks(len(msg.request.prompt_token_ids))
        num_messages = min(self.config.kv_messages, self.layer_push.num_layers)
        if num_messages > 1:
            self.layer_push.expect(rid, num_blocks, num_messages)  # NOTE: before the prompt is queued
        # NOTE: one message is gathered once the first token is sampled (_on_outputs) and sent by _push:
        # streamed, its gather and send would run on the GPU beside the step's last kernels (the lm_head and
        # the sampling), delaying the first token.

        async def run() -> Early | None:
            handshake = None
            try:
                lease, decode_worker = await self._lease(rid)
                lock = self._pair_locks.get(lease.decode_worker_id)
                if lock is None or not lock.locked():
                    ready = KvReadyMsg(
                        lease_id=lease.lease_id, prefill_worker_id=self.worker_id, request=msg.request,
                        first_token=None, num_blocks=num_blocks, num_messages=num_messages, draft=self._offer(rid),
                    )
                    handshake = await self._handshake(lease.decode_worker_id, decode_worker, ready)
            except TimeoutError:
                pass  # no lease: the push reports it
            finally:
                if handshake is not None and handshake.decode_id is not None:
                    self.layer_push.offer(rid, handshake.decode_id)
                else:
                    self.layer_push.close(rid)  # nothing goes early: the push gathers and sends itself
            return handshake

        return asyncio.ensure_future(run())

    async def _handshake(self, decode_id: str, decode_worker: Any, ready: KvReadyMsg) -> Early:
        """Takes the pair's lock, forms the pair if needed and has the decode worker post its
        receives. Accepted: returns with the lock HELD (the sends must follow in this order; `_send`
        releases it). Otherwise the lock is released and `failure` says why."""
        lock = self._pair_locks.setdefault(decode_id, asyncio.Lock())
        await lock.acquire()
        epoch = -1
        try:
            await self._ensure_pair(decode_id, decode_worker)
            epoch = self._pair_epochs[decode_id]
            accept = KvAcceptMsg.decode(await asyncio.wait_for(
                _invoke(decode_worker.kv_incoming, ready.encode()), self.config.pair_timeout_s
            ))
        except BaseException as err:
            lock.release()
            if self._pair_epochs.get(decode_id) == epoch or epoch < 0:
                self.transport.drop(decode_id)  # never waits on a dead peer; the pair re-forms next time
            if isinstance(err, asyncio.CancelledError):
                raise
            return Early(None, f"KV push to {decode_id} failed: {type(err).__name__}: {err}", epoch, lock, 1, False)
        if not accept.accepted:
            lock.release()
            if accept.is_unpaired and self._pair_epochs.get(decode_id) == epoch:
                self.transport.drop(decode_id)  # the decode side lost the pair: form it again next time
            return Early(None, f"decode worker refused the KV: {accept.reason}", epoch, lock, 1, False)
        return Early(decode_id, None, epoch, lock, ready.num_messages, accept.draft and ready.draft is not None)

    def _offer(self, request_id: str) -> DraftKvOffer | None:
        """The draft's KV offered with a request's KvReady: when this worker computes it."""
        return self.draft_offer if request_id in self._draft_kv else None

    def _settle(self, early: asyncio.Task[Early | None] | None, msg: PrefillTaskMsg) -> None:
        """An early handshake whose push will not come (the prefill failed or was cancelled): in the
        background, complete what the decode side waits for with a stand-in and token -1 (it then
        frees the lease), so the pair and its order stay intact."""
        if early is None:
            return
        num_blocks = self._num_blocks(len(msg.request.prompt_token_ids))

        async def settle() -> None:
            handshake = await early
            if handshake is not None:
                streamed = self.layer_push.close(msg.request.request_id)
                await self._send(handshake, None, -1, num_blocks, streamed)

        asyncio.ensure_future(settle())

    async def _send(
        self, handshake: Early, buf: torch.Tensor | None, token: int | None, num_blocks: int,
        streamed: Streamed | None = None, marks: list[float] | None = None,
        draft_kv: asyncio.Future[torch.Tensor] | None = None,
    ) -> tuple[str | None, float]:
        """After an accepted handshake: sends the KV's layer groups that the engine thread did not
        (`streamed`: what it did; `buf`, else the streamed buffer, else a stand-in of the KV's size)
        and then `token` (None: it went with KvReady), releases the pair (or leaves that to the send
        of the draft's KV, if the decode side asked for it: `_send_draft`, which the answer does not
        wait for), and waits for all. Returns what went wrong (None: nothing; a refused handshake's
        failure as is) and the KV sends' device seconds."""
        decode_id = handshake.decode_id
        if decode_id is None:
            return handshake.failure, 0.0
        device = self.loop.engine.device
        handles: list[TransferHandle] = list(streamed.handles) if streamed is not None else []
        failure: str | None = None
        keeps_lock: asyncio.Future[None] | None = None  # the draft's send, which releases the pair's lock
        try:
            groups = layer_groups(self.layer_push.num_layers, handshake.num_messages)
            if len(handles) < len(groups):
                if buf is None and streamed is not None:
                    buf = streamed.buffer
                if buf is None:
                    layout = self.transport.layout
                    buf = torch.empty(layout.buffer_shape(num_blocks), dtype=layout.torch_dtype, device=device)
                handles.extend(self.transport.send(decode_id, buf[first:stop]) for first, stop in groups[len(handles):])
            if token is not None:
                handles.append(self.transport.send(decode_id, upload([token], torch.int64, device)))
            if handshake.draft:  # NOTE: it keeps the pair's lock until the draft's KV is sent
                draft_kv = draft_kv if token != -1 else None
                keeps_lock = asyncio.ensure_future(self._send_draft(handshake, draft_kv, num_blocks))
            if marks is not None:
                marks.append(time.perf_counter())  # every send issued
        except Exception as err:  # noqa: BLE001 - this request's failure
            failure = f"failed: {type(err).__name__}: {err}"
        finally:
            if keeps_lock is None:
                handshake.lock.release()
        for handle in handles:
            if failure is None:
                failure = await wait_transfer(handle, self.config.transfer_timeout_s)
        if marks is not None:
            marks.append(time.perf_counter())  # every send done
        if failure is not None:
            if self._pair_epochs.get(decode_id) == handshake.epoch:
                self.transport.drop(decode_id)  # never waits on a dead peer; the pair re-forms next time
            return f"KV push to {decode_id} {failure}", 0.0
        kv_handles = handles[: len(groups)]
        return None, sum(h.device_seconds() or 0.0 for h in kv_handles)

    async def _draft_buffer(self, draft_kv: asyncio.Future[torch.Tensor] | None, num_blocks: int) -> torch.Tensor:
        """The draft's KV once computed; a stand-in of its size when there is none to send (nothing
        to decode, or the draft's prefill failed: that decode worker's draft then drafts poorly for
        this request, which verification keeps exact)."""
        if draft_kv is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(draft_kv), self.config.transfer_timeout_s)
            except Exception as err:  # noqa: BLE001 - logged; the stand-in keeps the pair's order
                log.error("no draft KV to send (%s: %s); sending a stand-in", type(err).__name__, err)
        assert self.draft is not None and self.draft_layout is not None
        layout, device = self.draft_layout, self.loop.engine.device
        with self.draft.stream_context():
            return torch.empty(layout.buffer_shape(num_blocks), dtype=layout.torch_dtype, device=device)

    async def _send_draft(
        self, handshake: Early, draft_kv: asyncio.Future[torch.Tensor] | None, num_blocks: int
    ) -> None:
        """The draft's KV, last on the pair once computed (a stand-in without one), then the pair's
        lock released; the answer does not wait for it. A failed send drops the pair."""
        assert self.draft is not None and handshake.decode_id is not None
        decode_id = handshake.decode_id
        try:
            buf = await self._draft_buffer(draft_kv, num_blocks)
            with self.draft.stream_context():  # NOTE: the pair's stream waits for the draft's work
                handle = self.transport.send(decode_id, buf)
        except Exception as err:  # noqa: BLE001 - the decode side's receive times out; the pair goes
            log.warning("draft KV push to %s failed: %s: %s", decode_id, type(err).__name__, err)
            if self._pair_epochs.get(decode_id) == handshake.epoch:
                self.transport.drop(decode_id)
            return
        finally:
            handshake.lock.release()
        failure = await wait_transfer(handle, self.config.transfer_timeout_s)
        if failure is not None:
            log.warning("draft KV push to %s %s", decode_id, failure)
            if self._pair_epochs.get(decode_id) == handshake.epoch:
                self.transport.drop(decode_id)  # never waits on a dead peer; the pair re-forms next time

    async def _push(
        self, task: PrefillTaskMsg, out: StepOutput, early: asyncio.Task[Early | None] | None = None
    ) -> PrefillResultMsg:
        """Sends the prompt's KV (and, after an early handshake, the first token) to the leased
        blocks. After an early handshake the decode side waits for both even when there is nothing to
        decode (aborted, or finished by the first token): it gets a stand-in or the real KV, and token
        -1, on which it frees the lease. Without one, the handshake happens now, first token included."""
        request = task.request
        rid = request.request_id
        result = self._first_answer(rid, out)
        aborted, finish = self._ending(task, out)
        decode = not aborted and finish is None
        num_blocks = self._num_blocks(len(request.prompt_token_ids))
        handshake = await asyncio.shield(early) if early is not None else None
        token: int | None = out.new_token_ids[0] if decode else -1
        if handshake is None:  # the handshake after the prefill, the first token in KvReady
            if not decode:
                return self._undecoded(result, aborted, finish)
            try:
                lease, decode_worker = await self._lease(rid)
            except TimeoutError as err:
                return PrefillResultMsg(**result, error=str(err))
            ready = KvReadyMsg(
                lease_id=lease.lease_id, prefill_worker_id=self.worker_id, request=request,
                first_token=token, num_blocks=num_blocks, draft=self._offer(rid),
            )
            handshake, token = await self._handshake(lease.decode_worker_id, decode_worker, ready), None
        marks = [time.perf_counter()]  # the push starts; then its sends issued, then done (push_marks_s)
        # NOTE: closed before anything else goes on the pair: the engine thread sends nothing more for it.
        streamed = self.layer_push.close(rid) if early is not None else None
        gathered = self._gathered.pop(rid, None)
        buf: torch.Tensor | None = None
        if streamed is not None and streamed.was_claimed:
            buf = streamed.buffer  # the step gathered (and sent) its layer groups as it computed them
        elif decode:
            if gathered is None:  # NOTE: not gathered when the prefill ended (it failed there): gather now
                blocks = (out.kv_block_ids or [])[:num_blocks]
                gathered = Gathered(await self._call(lambda e: gather_blocks(e.runner.kv_caches, blocks)), None, None)
            buf = gathered.buffer
        # NOTE: shielded: cancelled here, the sends still go and the pair's lock is still released.
        draft_kv = self._draft_kv.get(rid)
        failure, send_s = await asyncio.shield(
            asyncio.ensure_future(self._send(handshake, buf, token, num_blocks, streamed, marks, draft_kv))
        )
        if not decode:
            return self._undecoded(result, aborted, finish)
        if failure is not None:
            return PrefillResultMsg(**result, error=failure)
        assert buf is not None
        if streamed is not None and streamed.was_claimed:
            gather_s = streamed.gather_device_seconds()
        else:
            gather_s = gathered.device_seconds() if gathered is not None else 0.0
        return PrefillResultMsg(
            **result, push_bytes=buf.numel() * buf.element_size(), gather_device_s=gather_s, send_device_s=send_s,
            num_streamed_messages=len(streamed.handles) if streamed is not None else 0,
            push_tail_device_s=streamed.tail_device_seconds() if streamed is not None else 0.0,
            layers_written_at_offer=streamed.layers_written_at_offer if streamed is not None else -1,
            push_marks_s=marks,
        )

    @staticmethod
    def _undecoded(result: dict[str, Any], aborted: bool, finish: str | None) -> PrefillResultMsg:
        """The answer for a prompt with nothing to decode: aborted, or ended by its first token."""
        if aborted:
            return PrefillResultMsg(**result, finish_reason="abort", error="aborted")
        return PrefillResultMsg(**result, finish_reason=finish)

    def _finish_reason(self, out: StepOutput, num_prompt_tokens: int, max_tokens: int) -> str | None:
        if out.finish_reason == "stop":
            return "stop"  # the first token is an end-of-sequence or stop token
        if max_tokens == 1 or num_prompt_tokens + 1 >= self.max_seq_tokens:
            return "length"
        return None

    async def _ensure_pair(self, decode_id: str, decode_worker: Any) -> None:
        if self.transport.is_paired(decode_id):
            return
        timeout = self.config.pair_timeout_s
        host, port = await asyncio.wait_for(_invoke(decode_worker.transport_address), timeout)
        address = PairAddress(host, port)
        # NOTE: both sides' pair() are bounded by `timeout`; the extra second lets the peer's own
        # timeout error, which names the cause, arrive first.
        await asyncio.wait_for(asyncio.gather(
            _invoke(decode_worker.accept_pair, self.worker_id),
            asyncio.to_thread(self.transport.pair, decode_id, address, 1, timeout),
        ), timeout + 1.0)
        self._pair_epochs[decode_id] = self._pair_epochs.get(decode_id, 0) + 1

    async def abort(self, request_id: str) -> bool:
        """Idempotent: stops the prompt's computation; a push under way ends as aborted."""
        if request_id in self._live:
            self._aborted.add(request_id)
        lease = self._leases.get(request_id)
        if lease is not None and not lease.done():  # nothing waits for a lease that will not come
            lease.set_exception(TimeoutError(f"request {request_id!r} was aborted before its lease came"))
            lease.exception()  # NOTE: marks it read: no "never retrieved" warning if nothing awaits it
        was_live = await self._call(lambda e: e.abort_request(request_id))
        future = self._first_tokens.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(StepOutput(request_id, [], None, None, "abort", 0, 0))
        return was_live

    async def channel_address(self) -> ChannelAddress:
        """Where routers open the request channel (prefill, attach_lease and abort go there instead
        of through Ray): (host, port, secret)."""
        return await self.channel.address()

    # ---- introspection
    async def stats(self) -> dict[str, Any]:
        s = await self._call(lambda e: e.stats())
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),  # where its memory can be watched (bench/soak.py)
            **s.load(),
            "num_cached_blocks": s.num_cached_blocks,
            "num_channels": self.channel.num_connections,  # routers connected over the request channel
            "num_pushes_under_way": len(self._pushing),  # after their answers (answer_before_push)
            **self.push_log.stats(),
            "is_healthy": await self.health(),
        }

    async def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """How many leading tokens of a prompt this worker's prefix cache holds (for dispatch)."""

        def lookup(engine: EngineCore) -> int:
            from engine.kv_cache import hash_full_blocks

            hashes = hash_full_blocks(prompt_token_ids, engine.pool.block_size, [])
            return len(engine.pool.find_cached_prefix(hashes)) * engine.pool.block_size

        return await self._call(lookup)

    async def shutdown(self) -> None:
        await self.channel.close()
        self.loop.stop()
        self.transport.close()


async def _invoke(method: Any, *args: Any) -> Any:
    """Calls a peer's method: a Ray actor method (`.remote`) or, in-process, a coroutine function."""
    remote = getattr(method, "remote", None)
    if remote is not None:
        return await remote(*args)
    return await method(*args)


def _resolve_drafts(futures: list[asyncio.Future[torch.Tensor]], buffers: list[torch.Tensor | BaseException]) -> None:
    for future, buf in zip(futures, buffers):
        if future.done():
            continue
        if isinstance(buf, BaseException):
            future.set_exception(buf)
            future.exception()  # NOTE: marks it read: a push that no longer waits logs nothing
        else:
            future.set_result(buf)


def _draft_prefiller(config: PrefillWorkerConfig) -> DraftPrefiller:
    """The draft of config.engine.speculative, on the device the engine will use, for prompts of
    up to one engine step."""
    m = config.engine.model
    device = resolve_device(m.device)
    target_arch = load_arch(resolve_model_dir(m.model))
    return DraftPrefiller(
        config.engine.speculative, m, target_arch, device, resolve_dtype(m.dtype, device),
        config.engine.cache.block_size, config.engine.scheduler.max_num_batched_tokens,
    )


__all__ = ["PrefillWorker", "PrefillWorkerConfig"]


def _log_failure(done: Any) -> None:
    """Done-callback of an engine command nobody awaits: its failure goes to the log."""
    if not done.cancelled() and done.exception() is not None:
        log.error("engine command failed: %s", done.exception())
