"""EngineStats: what an engine reports of itself, a snapshot taken on its thread (EngineCore.stats, with
the loop's account of its thread added by EngineLoop.stats)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ENGINE_ONLY", "EngineStats"]

ENGINE_ONLY = frozenset({"num_spec_verifications", "num_spec_rejections", "num_spec_emitted_tokens"})


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int  # to be computed, or computed elsewhere and waiting for a place in the batch (max_num_seqs)
    num_running: int
    num_blocks: int
    num_free_blocks: int  # free or cached-and-evictable
    num_cached_blocks: int  # registered in the prefix cache (held or not)
    num_preemptions: int  # since start
    # Speculative decoding, since start (engine/spec/adaptive.py: SpecCounters says how to read them).
    num_spec_draft_tokens: int = 0  # drafted tokens verified
    num_spec_accepted_tokens: int = 0
    num_spec_verifications: int = 0  # request-steps that verified drafted tokens
    num_spec_rejections: int = 0  # verifications that rejected a drafted token
    num_spec_emitted_tokens: int = 0  # tokens the verifications produced
    num_spec_gate_overturns: int = 0  # probes that changed whether a batch size drafts (engine/spec/gate.py)
    # Speed and queue (engine/step_rates.py; 0.0: not measured yet), for the router's prefill choice.
    num_queued_prompt_tokens: int = 0  # prompt tokens admitted or waiting, not computed yet
    decode_step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    num_prompt_tokens_computed: int = 0  # since start
    num_prompts_started: int = 0  # since start: with the tokens, the mean prompt length the autoscaler reads
    kv_bytes_per_token: int = 0  # the whole worker's (every rank's heads)
    max_num_seqs: int = 0  # the running batch's cap (SchedulerConfig.max_num_seqs)
    weights: str = ""  # how its projections are stored and multiplied (EngineCore.weights)
    kv_cache_dtype: str = ""
    kv_scales: str = ""  # an FP8 cache's scales: "checkpoint" (per layer, from it) or "unit"; "" for another cache
    parallel: str = ""  # a tensor-parallel worker's ranks and its small all-reduces' path (EngineCore.parallel)
    # Where the engine thread's time went, since start (engine/loop.py fills them; 0 without a loop): steps
    # taken, wall seconds inside them and inside the commands run between them (requests joining, stats)
    num_engine_steps: int = 0
    engine_step_seconds: float = 0.0
    engine_command_seconds: float = 0.0
    longest_recent_step_seconds: float = 0.0  # the longest wall time of its last steps (engine/loop.py)
    # the CUDA caching allocators of every rank, since start (engine/parallel/rank_stats.py; the other ranks' one
    # stats call behind): cudaMalloc calls retried after freeing the cache, and cudaFree calls (each syncs)
    num_alloc_retries: int = 0
    num_device_frees: int = 0
    # the device time of every step taken (engine/step_timer.py) and the host's wait for asynchronous steps'
    # tokens inside steps, since start: what a step's wall time leaves beside these two is the host's own work
    step_device_seconds: float = 0.0
    step_wait_seconds: float = 0.0
    # the grammar process's (engine/grammar_book.py) seconds on the engine's constrained work it has answered:
    # advancing matchers and filling masks, beside the engine thread; since start
    grammar_work_seconds: float = 0.0
    # the other ranks' loops (engine/parallel/follower.py), the most of any rank, since start, one stats call
    # behind: seconds launching forwards, in RankCalls (KV moves), and the longest RankCall of the last 10 s
    follower_forward_seconds: float = 0.0
    follower_call_seconds: float = 0.0
    follower_longest_call_seconds: float = 0.0
    # the collector's pauses (each holds the GIL), this process's while its loop runs (engine/loop.py) and the other
    # ranks' (the most of any): seconds since start, and the longest of the last 10 s
    gc_seconds: float = 0.0
    longest_recent_gc_seconds: float = 0.0
    follower_gc_seconds: float = 0.0
    follower_longest_gc_seconds: float = 0.0

    def load(self) -> dict[str, int | float | str]:
        """What a worker reports of its engine (its stats, `pdserve status`, the metrics): every field but the
        speculative counters only the benchmarks read."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ENGINE_ONLY}

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted per verified drafted token (None before any)."""
        return self.num_spec_accepted_tokens / self.num_spec_draft_tokens if self.num_spec_draft_tokens else None
