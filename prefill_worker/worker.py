"""PrefillWorker: computes prompts (batched under a token budget, chunked, prefix-cache hits reused),
answers the router with each first token as soon as it is sampled, then pushes the prompt's KV into
the blocks the request's decode worker leased.

An async Ray actor body (cluster/ wraps it with ray.remote); in unit tests a plain object. Each
request is a PrefillJob (prefill_worker/job.py: its states, transitions and who hears of a failure);
this module drives jobs through them. Routers reach `prefill` and `abort` over the request channel
(protocol/channel.py, `channel_address`) or as Ray calls. Bad input raises InvalidRequestError (the
router answers 4xx and retries nothing). What it does not know: how the router picked the decode
worker, or what the decode worker does with the KV.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from typing import Any

import torch

from engine import EngineCore, SpeculativeConfig, StepOutput
from engine.loop import EngineLoop
from engine.parallel import RankStarter
from engine.parallel.local import LocalRanks
from engine.validation import InvalidRequestError
from kvtransfer.ranked import RankedKv, model_layout
from kvtransfer import create_transport, gather_blocks
from kvtransfer import transport_options as kv_transport_options
from kvtransfer.endpoint import TransferEndpoint, wait_transfer
from kvtransfer.netaddr import resolve_host
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.draft import DraftKv
from prefill_worker.job import JobState, PrefillJob
from prefill_worker.pairs import Pairs, PushFailed
from prefill_worker.pushes import Gathered, PushLog
from protocol.channel import Call, ChannelAddress, ChannelServer, Refs
from protocol.api import WorkerStatsMsg
from protocol.clients import DecodeClient
from protocol.messages import KvReadyMsg, PrefillResultMsg, PrefillTaskMsg, PushRecordMsg

log = logging.getLogger(__name__)


class PrefillWorker(TransferEndpoint):
    def __init__(self, config: PrefillWorkerConfig, transport_options: dict[str, Any] | None = None,
                 start_ranks: RankStarter = LocalRanks, engine: EngineCore | None = None) -> None:
        """start_ranks: how the other ranks of a tensor-parallel worker start (Ray actors in a cluster).
        engine: one already built (a worker changing role keeps its weights, cache and ranks; it sends no
        draft KV then, whose model it would have had to load first)."""
        self.config = config
        self.worker_id = config.worker_id
        # NOTE: built before the engine, which sizes its KV cache from the memory left.
        # NOTE: a tensor-parallel prefill worker sends no draft KV (the decode worker's draft computes the prompt).
        self.draft = DraftKv(config) if (config.engine.speculative.method == "draft" and engine is None
                                         and config.engine.parallel.tensor_parallel_size == 1) else None
        # A prefill worker never drafts: its engine runs without a proposer (and its memory).
        if engine is None:
            engine = EngineCore(config.engine.model_copy(update={"speculative": SpeculativeConfig()}),
                                start_ranks=start_ranks)
        self.block_size = engine.pool.block_size
        self.max_seq_tokens = engine.max_seq_tokens
        host = resolve_host(config.host)
        options = kv_transport_options(config.transport, host, transport_options)
        kv = engine.runner.kv_caches
        layout = model_layout(kv, engine.arch.num_kv_heads, engine.kv_scales)
        self.transport = create_transport(config.transport, self.worker_id, layout, engine.device, **options)
        # Every rank's share of each push (kvtransfer/ranked.py); with TP=1 this transport alone.
        self.kv = RankedKv(self.worker_id, self.transport, kv, engine.arch.num_kv_heads,
                           engine.tp.group if engine.tp is not None else None, config.transport, options,
                           config.pair_timeout_s)
        self.pairs = Pairs(self.kv, self.worker_id, config.pair_timeout_s)
        # The routers' request channel, listening from the first channel_address call; the decode
        # worker a call names comes as a reference (its pickled actor handle), loaded by self.refs.
        self.refs = Refs()
        self.channel = ChannelServer({
            Call.PREFILL: lambda task, ref: self.prefill(task, self.refs.decode(ref)),
            Call.ABORT: self.abort,
        }, None, host)
        self.jobs: dict[str, PrefillJob] = {}  # the requests not ended here
        self.num_ended: Counter[JobState] = Counter()  # jobs by final state, since start
        self.push_log = PushLog()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.loop = EngineLoop(engine, self._on_outputs, self._on_engine_error, name=f"{self.worker_id}-engine")
        self.loop.start(freeze_gc=config.freeze_gc)

    # ---- the engine thread's side
    def _on_outputs(self, outputs: list[StepOutput]) -> None:  # engine thread
        """Each first token to its job on the event loop; the KV of each prompt that goes on to a
        decode worker gathered into one buffer now, queued right behind the step that computed it;
        then the draft's KV of those prompts."""
        assert self._aio is not None
        gathered: dict[str, Gathered] = {}
        prompts: list[tuple[str, list[int]]] = []
        for out in outputs:
            job = self.jobs.get(out.request_id)  # NOTE: a racy read; the event loop owns `jobs`
            if (job is not None and out.kv_block_ids and out.finish_reason != "abort"
                    and self._finish_reason(job, out) is None):
                gathered[out.request_id] = self._gather(out.request_id, out.kv_block_ids[: self._num_blocks(job)])
                prompts.append((out.request_id, job.task.request.prompt_token_ids))
        drafts = self.draft.claim(prompts) if self.draft is not None else []
        self._aio.call_soon_threadsafe(self._resolve, outputs, gathered)
        if self.draft is not None:
            self.draft.compute(drafts, self._aio)

    def _gather(self, request_id: str, blocks: list[int]) -> Gathered:  # engine thread
        """Rank 0's heads of the blocks into one buffer (timed); the other ranks gather theirs."""
        self.kv.gather_ranks(request_id, blocks)
        kv = self.loop.engine.runner.kv_caches
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
            job = self.jobs.get(out.request_id)
            if job is not None and not job.first_token.done():
                job.gathered = gathered.get(out.request_id)
                job.first_token.set_result(out)

    def _fail_all(self, err: BaseException) -> None:
        for job in self.jobs.values():
            if not job.first_token.done():
                job.first_token.set_exception(RuntimeError(f"prefill worker {self.worker_id} failed: {err}"))

    # ---- a job's life
    async def prefill(self, task: bytes, decode_worker: Any) -> bytes:
        """Computes the prompt and answers with its first token (PrefillResultMsg); the KV then goes
        to `decode_worker` (an actor handle, or the worker itself in-process) in the background."""
        self._aio = asyncio.get_running_loop()
        msg = PrefillTaskMsg.decode(task)
        rid = msg.request.request_id
        if rid in self.jobs:
            raise ValueError(f"request {rid!r} is already being prefilled here")
        decode = DecodeClient(msg.lease.decode_worker_id, decode_worker)
        job = PrefillJob(msg, decode, self._aio.create_future(), self._end)
        self.jobs[rid] = job
        if self.draft is not None:
            job.draft_offer = self.draft.want(rid, msg.request.prompt_token_ids, self._aio)
        try:
            answer = await self._compute(job)
        except BaseException as err:  # cancelled, or the client's bad input: the job ends here
            if not job.state.is_final:
                job.move(JobState.FAILED, f"{type(err).__name__}: {err}")
            raise
        answered = time.perf_counter()
        if job.state is JobState.ANSWERED:
            job.push = asyncio.ensure_future(self._push(job))
        return answer.model_copy(update={
            "worker_s": answered - job.arrived_at, "arrived_at": job.arrived_at, "answered_at": answered,
        }).encode()

    async def _compute(self, job: PrefillJob) -> PrefillResultMsg:
        """QUEUED -> COMPUTING -> ANSWERED (-> DONE when the first token ends the request), or the
        job's end: the answer says how."""
        request = job.task.request
        rid = request.request_id
        params = request.params
        first = params.model_copy(update={"max_tokens": 1, "min_tokens": min(1, params.min_tokens)})
        try:
            if params.grammar is not None:
                await asyncio.to_thread(self.loop.prepare, params)
            await self._call(lambda e: e.add_request(
                rid, request.prompt_token_ids, first, hold_kv=True,
                num_prior_output_tokens=request.num_prior_output_tokens,
            ))
        except InvalidRequestError as err:
            job.move(JobState.FAILED, str(err))
            raise  # the client's mistake: no other worker would take it either
        except Exception as err:  # noqa: BLE001 - this worker's failure: the router retries elsewhere
            job.move(JobState.FAILED, str(err))
            return PrefillResultMsg(request_id=rid, error=str(err))
        if job.is_aborted:  # NOTE: the abort's own engine command, queued behind the prompt, removes it
            job.move(JobState.ABORTED)
            return PrefillResultMsg(request_id=rid, finish_reason="abort", error="aborted")
        job.move(JobState.COMPUTING)
        started = time.perf_counter()
        try:
            out = await job.first_token
        except Exception as err:  # noqa: BLE001 - the engine failed
            job.move(JobState.FAILED, str(err))
            return PrefillResultMsg(request_id=rid, error=str(err))
        job.sampled_at = time.perf_counter()
        if out.finish_reason == "abort" or job.is_aborted:
            job.move(JobState.ABORTED)
            return PrefillResultMsg(request_id=rid, finish_reason="abort", error="aborted")
        finish = self._finish_reason(job, out)
        layout, num_blocks = self.transport.layout, self._num_blocks(job)
        answer = PrefillResultMsg(
            request_id=rid,
            first_token=out.new_token_ids[0],
            logprob=out.logprobs[0] if out.logprobs else None,
            top_logprobs=out.top_logprobs[0] if out.top_logprobs else None,
            finish_reason=finish,
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prefill_s=job.sampled_at - started,
            push_bytes=0 if finish else layout.torch_dtype.itemsize * math.prod(layout.buffer_shape(num_blocks)),
        )
        job.answered = answer
        job.move(JobState.ANSWERED)
        if finish is not None:
            job.move(JobState.DONE)  # nothing to decode: the router frees the lease
        return answer

    async def _push(self, job: PrefillJob) -> None:
        """ANSWERED -> PUSHING -> DONE, or FAILED / ABORTED. A push that cannot start tells the
        decode worker (KvReadyMsg.failure), which tells the router; one that fails while sending is
        seen by the decode worker's receive."""
        if job.is_aborted:
            job.move(JobState.ABORTED)
            return
        request, lease, answer = job.task.request, job.task.lease, job.answered
        assert answer is not None and answer.first_token is not None
        ready = KvReadyMsg(
            lease_id=lease.lease_id, prefill_worker_id=self.worker_id, request=request,
            first_token=answer.first_token, num_blocks=self._num_blocks(job), draft=job.draft_offer,
        )
        try:
            handshake = await self.pairs.handshake(job.decode, ready)
        except PushFailed as err:
            if not err.decode_knows:
                await self._tell_decode(job, ready.model_copy(update={"failure": err.reason}))
            job.move(JobState.FAILED, err.reason)
            return
        job.move(JobState.PUSHING)
        marks = [time.perf_counter() - job.sampled_at]  # seconds after the first token: handshake accepted
        decode_id, handles, failure = handshake.decode_id, [], None
        try:
            if job.gathered is None:
                raise RuntimeError("the prompt's KV was not gathered")
            handles.append(self.kv.send(decode_id, request.request_id, job.gathered.buffer))
            if handshake.takes_draft:  # NOTE: last on the pair, the lock held until it is issued
                assert self.draft is not None
                buf = await self.draft.buffer(request.request_id, ready.num_blocks, self.config.transfer_timeout_s)
                with self.draft.stream_context():  # the pair's stream waits for the draft's work
                    handles.append(self.transport.send(decode_id, buf))
        except Exception as err:  # noqa: BLE001 - the decode side's receive times out and tells the router
            failure = f"failed: {type(err).__name__}: {err}"
        finally:
            handshake.release()
        marks.append(time.perf_counter() - job.sampled_at)  # the sends issued
        for handle in handles:
            failure = failure or await wait_transfer(handle, self.config.transfer_timeout_s)
        if failure is not None:
            self.pairs.drop(decode_id, handshake.epoch)  # never waits on a dead peer; the pair re-forms next time
            job.move(JobState.FAILED, f"KV push to {decode_id} {failure}")
            return
        marks.append(time.perf_counter() - job.sampled_at)  # the sends done
        if not job.is_aborted:  # NOTE: aborted meanwhile, the move below ends it ABORTED (counted as cancelled)
            self.push_log.pushed(PushRecordMsg(
                request_id=request.request_id, push_bytes=answer.push_bytes, push_s=marks[-1],
                gather_device_s=job.gathered.device_seconds(), send_device_s=handles[0].device_seconds() or 0.0,
                push_marks_s=marks,
            ))
        job.move(JobState.DONE)

    async def _tell_decode(self, job: PrefillJob, failed: KvReadyMsg) -> None:
        """The push will not come: the decode worker frees the lease and tells the router. A decode
        worker that cannot be reached is dead or hung, which the router sees itself."""
        try:
            await asyncio.wait_for(job.decode.kv_incoming(failed), self.config.pair_timeout_s)
        except Exception as err:  # noqa: BLE001 - see above
            log.info("could not tell %s that the push of %s failed: %s", failed.lease_id, job.request_id, err)

    def _end(self, job: PrefillJob) -> None:
        """A job's final transition: it is forgotten, its prompt leaves the engine and its blocks go
        to the prefix cache."""
        rid = job.request_id
        self.jobs.pop(rid, None)
        self.num_ended[job.state] += 1
        if JobState.ANSWERED in job.history and job.state is not JobState.DONE:  # a push was due, not done
            self.push_log.ended(failed=job.state is JobState.FAILED)
        if self.draft is not None:
            self.draft.forget(rid)
        if JobState.PUSHING not in job.history:
            self.kv.forget(rid)  # NOTE: the other ranks' gathered buffers, when no push took them
        # NOTE: abort_request, not only release_held: a job cancelled while its prompt waited in the engine
        # (its router's connection went) would have it computed later into KV held for nobody, and a worker
        # holding blocks never drains. Not awaited: later engine commands queue behind it.
        self.loop.submit(lambda e: e.abort_request(rid)).add_done_callback(_log_failure)

    async def abort(self, request_id: str) -> bool:
        """Idempotent: a job not yet answered stops computing and answers "aborted"; one answered
        ends ABORTED once what its push started is over. False: nothing of it is here."""
        job = self.jobs.get(request_id)
        if job is None or not job.abort():
            return False
        if job.state in (JobState.QUEUED, JobState.COMPUTING):
            await self._call(lambda e: e.abort_request(request_id))
            if not job.first_token.done():
                job.first_token.set_result(StepOutput(request_id, [], None, None, "abort", 0, 0))
        return True

    def _num_blocks(self, job: PrefillJob) -> int:
        """Blocks the prompt's KV fills, the ones its push moves."""
        return -(-job.num_prompt_tokens // self.block_size)

    def _finish_reason(self, job: PrefillJob, out: StepOutput) -> str | None:
        """Why the first token ends the request, or None when it goes on to a decode worker."""
        if out.finish_reason == "stop":
            return "stop"  # an end-of-sequence or stop token
        if job.task.request.params.max_tokens == 1 or job.num_prompt_tokens + 1 >= self.max_seq_tokens:
            return "length"
        return None

    # ---- introspection
    async def channel_address(self) -> ChannelAddress:
        """Where routers open the request channel: (host, port, secret)."""
        return await self.channel.address()

    async def settle_pushes(self, timeout_s: float | None = None) -> int:
        """Waits (at most timeout_s; default: as long as a started push can last, `longest_push_s`) for the
        pushes under way; returns how many still are."""
        pushes = [job.push for job in self.jobs.values() if job.push is not None]
        if pushes:
            await asyncio.wait(pushes, timeout=self.config.longest_push_s if timeout_s is None else timeout_s)
        return sum(1 for job in self.jobs.values() if job.push is not None and not job.push.done())

    async def push_records(self) -> list[bytes]:
        """The latest pushes that ended well, oldest first (PushRecordMsg)."""
        return [r.encode() for r in self.push_log.records]

    async def check_integrity(self) -> int:
        """As TransferEndpoint's, once the pushes under way have ended (they hold their blocks)."""
        await self.settle_pushes()
        return await super().check_integrity()

    async def stats(self) -> WorkerStatsMsg:
        s = await self._call(lambda e: self.loop.stats())
        return WorkerStatsMsg(
            worker_id=self.worker_id, role="prefill", pid=os.getpid(), is_healthy=await self.health(), **s.load(),
            num_channels=self.channel.num_connections, num_jobs=len(self.jobs),
            num_pushing=sum(1 for j in self.jobs.values() if j.state is JobState.PUSHING),
            push_totals=self.push_log.totals, jobs_ended={state.value: n for state, n in self.num_ended.items()},
        )

    async def shutdown(self, keep_engine: bool = False) -> None:
        """keep_engine: leave the engine (and its ranks) for the role that follows."""
        await self.channel.close()
        self.kv.close()
        self.loop.stop()
        if not self.loop.is_alive and not keep_engine:
            self.loop.engine.close()  # the other ranks of a tensor-parallel worker
        self.transport.close()


def _log_failure(done: Any) -> None:
    """Done-callback of an engine command nobody awaits: its failure goes to the log."""
    if not done.cancelled() and done.exception() is not None:
        log.error("engine command failed: %s", done.exception())


__all__ = ["PrefillWorker", "PrefillWorkerConfig"]
