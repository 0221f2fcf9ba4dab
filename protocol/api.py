"""The worker interfaces as their callers see them, typed: `PrefillAPI` (a prefill worker, called by
routers), `DecodeAPI` (a decode or colocated worker, called by routers and, for the KV hand-off, by
prefill workers), and the stats every worker reports (`WorkerStatsMsg`). protocol/clients.py
implements them over a Ray actor handle, the request channel, or an in-process worker; the workers'
own methods take and answer the encoded messages.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field

from kvtransfer.ranked import RankTable
from protocol.messages import (
    GenerateRequestMsg,
    KvAcceptMsg,
    KvReadyMsg,
    LeaseMsg,
    LocalPrefillMsg,
    LocalPrefillReplyMsg,
    Msg,
    PrefillResultMsg,
    PrefillTaskMsg,
    PushTotalsMsg,
    ReserveMsg,
    TokenBatchMsg,
)


class WorkerStatsMsg(Msg):
    """What a worker reports of itself (`pdserve status`, the router's load tracking and metrics)."""

    worker_id: str
    role: Literal["prefill", "decode"]  # a colocated worker reports "decode": it runs the decode worker's code
    pid: int  # where its memory can be watched (bench/soak.py)
    is_healthy: bool
    num_waiting: int  # requests in its engine's queue
    num_running: int  # requests in its engine's running batch
    num_blocks: int  # KV blocks of its cache
    num_free_blocks: int
    num_cached_blocks: int = 0  # held by nobody, kept for prefix-cache hits
    num_channels: int = 0  # routers connected over the request channel
    # speed and queue (engine/step_rates.py; 0.0: not measured yet): the router's prefill choice reads them
    num_queued_prompt_tokens: int = 0
    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    num_prompt_tokens_computed: int = 0  # since start; the autoscaler's prompt load is its differences
    num_prompts_started: int = 0  # since start (prompts admitted to compute here); the mean prompt length's divisor
    kv_bytes_per_token: int = 0
    max_num_seqs: int = 0  # its running batch's cap (0: not reported)
    weights: str = ""  # e.g. "bfloat16", "fp8 projections on the cuda path" (engine.EngineCore.weights)
    kv_cache_dtype: str = ""  # e.g. "bfloat16", "float8_e4m3fn"
    kv_scales: str = ""  # an FP8 cache's: "checkpoint" (per-layer scales read from it) or "unit"; "" otherwise
    parallel: str = ""  # e.g. "TP=2, small all-reduces on symmetric memory"; "" for one GPU
    # its engine thread since start (engine/stats.py): steps, wall seconds in steps and in commands between
    # them; its CUDA allocator's retried cudaMallocs and its cudaFrees (each free synchronizes the device)
    num_engine_steps: int = 0
    engine_step_seconds: float = 0.0
    engine_command_seconds: float = 0.0
    longest_recent_step_seconds: float = 0.0  # the longest wall time of its engine's last 512 steps
    num_alloc_retries: int = 0
    num_device_frees: int = 0
    # inside its steps since start: their device time, and the host's wait for their tokens; its other ranks'
    # loops (the most of any rank): seconds launching forwards, in KV moves, the longest move lately
    step_device_seconds: float = 0.0
    step_wait_seconds: float = 0.0
    grammar_work_seconds: float = 0.0  # its grammar process's, on constrained requests' masks, since start
    follower_forward_seconds: float = 0.0
    follower_call_seconds: float = 0.0
    follower_longest_call_seconds: float = 0.0
    # the garbage collector's pauses (each holds the GIL): its process's, and its other ranks' (the most of any)
    gc_seconds: float = 0.0
    longest_recent_gc_seconds: float = 0.0
    follower_gc_seconds: float = 0.0
    follower_longest_gc_seconds: float = 0.0
    # decode workers
    num_leases: int = 0  # open leases (reserved or receiving)
    num_undelivered: int = 0  # token rows not yet taken by their routers
    is_draining: bool = False
    num_preemptions: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_gate_overturns: int = 0  # the draft gate's changes of whether a batch size drafts (engine/spec/gate.py)
    num_draft_kv_adopted: int = 0  # prompts whose draft KV came from a prefill worker
    num_requests: int = 0  # requests that joined its batch since start (submitted, prefilled here, or pushed)
    computes_every_prompt: bool = False  # no prefill worker is left: it is sent whole requests (DecodeWorker)
    # prefill workers
    num_jobs: int = 0  # requests not ended here
    num_pushing: int = 0  # of them, pushing their KV
    push_totals: PushTotalsMsg = Field(default_factory=PushTotalsMsg)
    jobs_ended: dict[str, int] = Field(default_factory=dict)  # by final state (prefill_worker/job.py)


class CacheDeltaMsg(Msg):
    """A worker's prefix-cache changes since a router's cursor (engine/cache_events.py's CacheDelta):
    blocks of `block_size` tokens, named by their chained hashes, STORED (1) or REMOVED (0) in order, or
    (is_snapshot) every block held now."""

    epoch: str
    cursor: int
    is_snapshot: bool
    kinds: bytes
    hashes: list[bytes]
    block_size: int


class WorkerAPI(Protocol):
    worker_id: str

    async def abort(self, request_id: str) -> bool: ...
    async def stats(self) -> WorkerStatsMsg: ...
    async def cache_delta(self, epoch: str, cursor: int) -> CacheDeltaMsg: ...
    async def health(self) -> bool: ...
    async def check_integrity(self) -> int: ...


class DecodeAPI(WorkerAPI, Protocol):
    async def submit(self, request: GenerateRequestMsg) -> float: ...
    async def prefill_locally(self, local: LocalPrefillMsg) -> LocalPrefillReplyMsg: ...
    async def reserve(self, request: ReserveMsg) -> LeaseMsg | None: ...
    async def next_batch(self, router_id: str, timeout_s: float) -> TokenBatchMsg: ...
    async def kv_incoming(self, ready: KvReadyMsg) -> KvAcceptMsg: ...
    async def transport_address(self) -> RankTable: ...
    async def accept_pair(self, prefill_worker_id: str, prefill: RankTable) -> None: ...


class PrefillAPI(WorkerAPI, Protocol):
    async def prefill(self, task: PrefillTaskMsg, decode: DecodeAPI) -> PrefillResultMsg: ...


__all__ = ["CacheDeltaMsg", "DecodeAPI", "PrefillAPI", "WorkerAPI", "WorkerStatsMsg"]
