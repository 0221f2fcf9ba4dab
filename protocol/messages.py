"""The typed messages between router, prefill workers and decode workers, with a msgpack encoding.

The block-ownership protocol, in order (shared/DESIGN.md, "Life of a request"):

| step | from -> to         | message                                   | blocks change owner                    |
|------|--------------------|-------------------------------------------|----------------------------------------|
| 1    | router -> decode   | ReserveMsg -> LeaseMsg                    | decode: free -> held by the lease      |
| 2    | router -> prefill  | PrefillTaskMsg (the request and the lease)| prefill: computes, holds until pushed  |
| 3    | prefill -> router  | PrefillResultMsg (first token), at once   |                                        |
| 4    | prefill -> decode  | KvReadyMsg -> KvAcceptMsg (recv posted)   |                                        |
| 5    | prefill ~> decode  | the KV bytes over the pair's transport    | decode: lease -> running request       |
|      |                    | (then a draft's KV, if accepted)          | prefill: held -> prefix cache          |
| 6    | decode -> router   | TokenBatchMsg, one per step per router    | decode: freed when the request ends    |

After step 3 a failed push reaches the router on one path: the decode worker's token stream (a
KvReady it refuses or that carries `failure`, a receive that fails, a lease that expires), or the
decode worker's death, which the router sees itself.

A prompt may also skip the prefill worker (the router's prefill rule: a short prompt, or one the
decode worker's prefix cache mostly holds): router -> decode LocalPrefillMsg -> LocalPrefillReplyMsg
replaces steps 1 to 5; the decode worker computes the prompt itself, with no lease and no KV push
(decode: free or cached -> held by the running request), or declines and nothing changes.

An abort (by request id) may come at any step; it is idempotent and frees whatever the request holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from engine.config import SamplingParams

M = TypeVar("M", bound="Msg")


class Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def encode(self) -> bytes:
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        return cls.model_validate(msgpack.unpackb(data, raw=False))


class GenerateRequestMsg(Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    router_id: str  # whose TokenBatchMsg carries this request's tokens
    # A continuation of a request moved off a failed worker: the last prompt tokens that earlier
    # attempts generated. Seeded sampling continues the stream at this output position.
    num_prior_output_tokens: int = Field(0, ge=0)


class LocalPrefillMsg(Msg):
    """Router -> decode: compute this request's prompt here, then decode it (no prefill worker)."""

    request: GenerateRequestMsg
    # Decline unless the prefix cache holds at least this many leading prompt tokens (0: no condition):
    # the router's belief about the decode worker's cache, checked where the cache is.
    min_cached_tokens: int = 0


class LocalPrefillReplyMsg(Msg):
    accepted: bool
    reason: str = ""  # why not: draining, no room for the prompt's blocks, too little of it cached
    num_cached_tokens: int = 0  # leading prompt tokens found in the prefix cache


class ReserveMsg(Msg):
    request_id: str
    num_prompt_tokens: int
    router_id: str


class LeaseMsg(Msg):
    lease_id: str
    decode_worker_id: str
    block_ids: list[int]
    expires_at: float  # the decode worker's clock (time.time()); unclaimed blocks are freed then


class PrefillTaskMsg(Msg):
    """Router -> prefill, the one call of a disaggregated request: the request and the lease its
    KV goes to (the decode worker's handle travels beside it)."""

    request: GenerateRequestMsg
    lease: LeaseMsg


class DraftKvOffer(Msg):
    """With KvReadyMsg: the prefill worker also computed the prompt's KV for this draft model, and
    sends it (one message, as many blocks as the target's) if the decode worker posts a receive."""

    layout: list[int]  # kvtransfer.layout.KvLayout.to_ints() of the draft's cache
    fingerprint: str  # engine/spec/draft_load.py draft_fingerprint: the same weights on both sides


class KvReadyMsg(Msg):
    """Prefill -> decode, after the first token: the KV of the prompt is about to arrive over the pair
    (one message, then the draft's KV if accepted). With `failure` set it will not: the decode worker
    frees the lease and tells the router, which moves the request on."""

    lease_id: str
    prefill_worker_id: str
    request: GenerateRequestMsg
    first_token: int
    num_blocks: int  # blocks sent: ceil(num_prompt_tokens / block_size)
    draft: DraftKvOffer | None = None
    failure: str | None = None


class KvAcceptMsg(Msg):
    accepted: bool
    reason: str = ""  # why not: the lease expired or was aborted
    # Accepted with the draft's KV too (KvReadyMsg.draft): its receive is posted after the KV's, so it
    # comes last on the pair.
    draft: bool = False
    # Refused because the decode side has no pair with the sender (a failed transfer dropped it):
    # the sender drops its own, so its next push forms the pair again.
    is_unpaired: bool = False


class PrefillResultMsg(Msg):
    """Prefill -> router, as soon as the first token is sampled (the push goes on after it)."""

    request_id: str
    first_token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # set when the first token already ends the request ("abort": aborted)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # the prefill failed here (the router retries elsewhere)
    prefill_s: float = 0.0  # from the prompt queued in the engine to its first token
    push_bytes: int = 0  # what the push after this answer sends (0: nothing to push)
    worker_s: float = 0.0  # from the call's arrival at the prefill worker to its answer
    # The call's arrival and its answer on the worker's host clock (time.perf_counter, CLOCK_MONOTONIC on
    # Linux: comparable across the processes of one host): with the caller's own marks, the call's transit.
    arrived_at: float = 0.0
    answered_at: float = 0.0


class TtftCountsMsg(Msg):
    """A router's first tokens over its last `window_s` against the TTFT SLO it steers to (router/ttft_window.py),
    for the controller's autoscaler: `num_over_slo` of `num_first_tokens` came later than the SLO, counting the
    requests still waiting past it for theirs."""

    router_id: str
    window_s: float
    num_first_tokens: int
    num_over_slo: int


class PushRecordMsg(Msg):
    """One push that ended well, as its prefill worker timed it (PrefillWorker.push_records)."""

    request_id: str
    push_bytes: int
    push_s: float  # from the first token to the sends done (the handshake included)
    # The transfer's own time on the device (CUDA events; 0 on the CPU): the gather into one buffer,
    # and the send from the moment the pair's stream reached it.
    gather_device_s: float = 0.0
    send_device_s: float = 0.0
    # Seconds after the first token: the handshake accepted, the sends issued, the sends done.
    push_marks_s: list[float] = Field(default_factory=list)


class PushTotalsMsg(Msg):
    """A prefill worker's pushes since start (its stats; the router's gauges per worker)."""

    num_pushed: int = 0
    num_failed: int = 0  # each also reported to its router by the decode worker (or seen as its death)
    num_cancelled: int = 0  # their requests aborted (a client that left) before the push finished
    push_bytes: int = 0
    push_seconds: float = 0.0  # summed, each from the first token to its sends done
    send_device_seconds: float = 0.0  # summed: each push's first send on the device (with TP, rank 0's longest)


class TokenOutputMsg(NamedTuple):
    """One request's news from one decode step. A NamedTuple, not a Msg: a decode worker sends one
    per running request per step (thousands a second), so neither end pays for validation; both
    ends are pdserve's own, and TokenBatchMsg checks each row's arity on arrival."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


_TOKEN_OUTPUT_ARITY = len(TokenOutputMsg._fields)


@dataclass(frozen=True)
class TokenBatchMsg:
    """Decode (or colocated) worker -> router: every update of that router's requests since the
    last batch, encoded as one msgpack array of rows (a TokenOutputMsg packs as an array)."""

    worker_id: str
    outputs: list[TokenOutputMsg]
    # When the worker sent it, on its host's clock (time.perf_counter, CLOCK_MONOTONIC on Linux): a
    # router on the same host reads the batch's transit from it. 0.0: not stamped.
    sent_at: float = 0.0

    def encode(self) -> bytes:
        return msgpack.packb((self.worker_id, self.outputs, self.sent_at), use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> TokenBatchMsg:
        worker_id, rows, *stamp = msgpack.unpackb(data, raw=False)  # NOTE: an older worker sends no stamp
        sent_at = stamp[0] if stamp else 0.0
        arities = set(map(len, rows))
        if arities - {_TOKEN_OUTPUT_ARITY}:
            raise ValueError(
                f"TokenBatchMsg from {worker_id}: a row has {max(arities - {_TOKEN_OUTPUT_ARITY})} fields, a "
                f"TokenOutputMsg {_TOKEN_OUTPUT_ARITY}: the worker runs another pdserve version"
            )
        new_row = tuple.__new__  # NOTE: TokenOutputMsg._make less its own arity check, made above for all rows
        return cls(worker_id, [new_row(TokenOutputMsg, row) for row in rows], sent_at)
