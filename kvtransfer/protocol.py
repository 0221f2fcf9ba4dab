"""The typed messages between router, prefill workers and decode workers, with a msgpack encoding.

The block-ownership protocol, in order (shared/DESIGN.md, "Life of a request"):

| step | from -> to         | message                                   | blocks change owner                    |
|------|--------------------|-------------------------------------------|----------------------------------------|
| 1    | router -> decode   | ReserveMsg -> LeaseMsg                    | decode: free -> held by the lease      |
| 2    | router -> prefill  | PrefillTaskMsg                            | prefill: computes, holds until pushed  |
| 3    | prefill -> decode  | KvReadyMsg -> KvAcceptMsg (recv posted)   |                                        |
| 4    | prefill ~> decode  | the KV bytes over the pair's transport    | decode: lease -> running request       |
|      |                    | (then the first token, then a draft's KV) | (the draft's KV: into its own pool)    |
| 5    | prefill -> router  | PrefillResultMsg (first token)            | prefill: held -> prefix cache          |
| 6    | decode -> router   | TokenBatchMsg, one per step per router    | decode: freed when the request ends    |

A prompt may also skip the prefill worker (the router's prefill rule: a short prompt, or one the
decode worker's prefix cache mostly holds): router -> decode LocalPrefillMsg -> LocalPrefillReplyMsg
replaces steps 1 to 5; the decode worker computes the prompt itself, with no lease and no KV push
(decode: free or cached -> held by the running request), or declines and nothing changes.

An AbortMsg may come at any step; it is idempotent and frees whatever the request holds.
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
    request: GenerateRequestMsg
    lease: LeaseMsg | None = None  # None: the router attaches it later (PrefillWorker.attach_lease)


class DraftKvOffer(Msg):
    """With KvReadyMsg: the prefill worker also computed the prompt's KV for this draft model, and
    sends it (one message, as many blocks as the target's) if the decode worker posts a receive."""

    layout: list[int]  # kvtransfer.layout.KvLayout.to_ints() of the draft's cache
    fingerprint: str  # engine/spec/draft_load.py draft_fingerprint: the same weights on both sides


class KvReadyMsg(Msg):
    """Prefill -> decode: the KV of `num_prompt_tokens` tokens is about to arrive over the pair."""

    lease_id: str
    prefill_worker_id: str
    request: GenerateRequestMsg
    # None: sent before the prompt was computed (an early handshake); the first token follows the
    # KV over the pair as one int64, -1 meaning there is nothing to decode (free the lease).
    first_token: int | None
    num_blocks: int  # blocks sent: ceil(num_prompt_tokens / block_size)
    # The KV comes as this many messages, layers split by kvtransfer.layout.layer_groups (the
    # prefill side sends each group as soon as its step has computed those layers).
    num_messages: int = Field(1, ge=1)
    draft: DraftKvOffer | None = None


class KvAcceptMsg(Msg):
    accepted: bool
    reason: str = ""  # why not: the lease expired or was aborted
    # Accepted with the draft's KV too (KvReadyMsg.draft): its receive is posted after the first
    # token's (or after the KV when the first token came with KvReady), so it comes last on the pair.
    draft: bool = False
    # Refused because the decode side has no pair with the sender (a failed transfer dropped it):
    # the sender drops its own, so its next push forms the pair again.
    is_unpaired: bool = False


class PrefillResultMsg(Msg):
    request_id: str
    first_token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # set when the first token already ends the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # the request failed here (lease refused, transfer failed...)
    prefill_s: float = 0.0  # from arrival at the prefill worker to its first token
    push_s: float = 0.0  # from the first token to the KV's arrival acknowledged (gather + handshake + send)
    push_bytes: int = 0
    # Answered before its push ended (PrefillWorkerConfig.answer_before_push): push_bytes is what it
    # sends; push_s, the device times and the marks are not known yet (the prefill worker's
    # push_records and stats have them once it ends; a failure reaches the router from the decode worker).
    push_pending: bool = False
    # The transfer's own time on the device (CUDA events on its streams; 0 where not timed): the
    # gather into one buffer, and the send from the moment the pair's stream reached it.
    gather_device_s: float = 0.0
    send_device_s: float = 0.0
    # Layer groups the prefill step sent while it computed them (kvtransfer.layout.layer_groups); the
    # rest went after the step.
    num_streamed_messages: int = 0
    # Device seconds from the prefill step's last layer written to the last layer group sent (a
    # streamed push; 0 otherwise): the part of the transfer the forward did not hide.
    push_tail_device_s: float = 0.0
    layers_written_at_offer: int = -1  # layers the step had queued when the early handshake completed
    # Seconds after the first token (once answered; absolute perf_counter values inside the worker):
    # the push started, its sends were issued, they were done.
    push_marks_s: list[float] = Field(default_factory=list)
    worker_s: float = 0.0  # from the call's arrival at the prefill worker to its answer (all of the above and more)
    # The call's arrival and its answer, as the worker's host clock has them (time.perf_counter, which
    # is CLOCK_MONOTONIC on Linux: comparable across the processes of one host): with the caller's own
    # marks, the call's transit each way.
    arrived_at: float = 0.0
    answered_at: float = 0.0

    def with_push(self, record: PrefillResultMsg) -> PrefillResultMsg:
        """This answer, sent before its push ended, completed with that push's figures from the
        worker's push_records (its own timings and marks kept)."""
        if record.request_id != self.request_id:
            raise ValueError(f"push record of {record.request_id!r} given for the answer of {self.request_id!r}")
        fields = ("push_s", "push_bytes", "gather_device_s", "send_device_s", "num_streamed_messages",
                  "push_tail_device_s", "layers_written_at_offer", "push_marks_s")
        return self.model_copy(update={"push_pending": False, **{f: getattr(record, f) for f in fields}})


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


class AbortMsg(Msg):
    request_id: str

