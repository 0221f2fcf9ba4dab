"""The joint prefill/decode autoscaler: from the workers' stats against the SLOs, one change at a time
to the pools' sizes, within per-pool bounds and a GPU budget, without flapping.

Per pool, a pressure in [0, inf) where 1 means "at the SLO":
  prefill  the longest predicted prefill queue wait (queued prompt tokens / measured prefill rate)
           over the TTFT SLO's share for queueing (`ttft_queue_share`), or, where it is past 1 and
           higher, the prompt tokens a second arriving at all workers (`PromptLoad`) over the prefill
           workers' measured rates together: their queues grow however short they are now. (Queue waits alone
           rise and fall with bursts of long prompts: on 2x H200 at 20 req/s of 1-4k-token prompts,
           50k tokens/s against one prefill worker's 38k, the queue's pressure stayed past 1 for no
           10 s together, so the move to two workers that prefill came only at 24 req/s.)
  decode   the largest of the KV use (held / all blocks) over `max_kv_use`, the measured decode
           step time over the TPOT SLO, and the requests running and waiting over the running
           batch's cap (max_num_seqs): a decode worker whose batch is full and requests wait is
           pressed though its steps are quick and its KV has room.
A pool above `scale_up_at` for `sustain_s` grows by one worker (when the budget allows; otherwise, in
disaggregated mode, a worker of the other pool changes role to it if that pool is below
`scale_down_at`: drained, it flips in place, keeping its engine: cluster/flex_worker.py); a pool below `scale_down_at` for `sustain_s` shrinks by
one (never under its minimum), its worker moving to the other pool instead of leaving when that pool
is above `scale_up_at` then. A shrink that moves no worker is made only where it gives something back
(`releasable`: the newest worker sits on a GPU bundle its pool grew, or on none): the GPUs of a pool's
start group stay reserved whatever runs on them, so retiring a worker there would only cost the start
of the next one. After any change, nothing changes for `cooldown_s`: the hysteresis
between the two thresholds and the cooldown are what keep it from flapping. Every decision, and
why, is kept (`decisions`) for `pdserve status`.

The last prefill worker may go to decoding (min_prefill 0) for either pool's pressure. Then the decode
workers compute every prompt: the prompt tokens a second that arrived over the last `sustain_s`
(`PromptLoad`: computed, plus what the queues grew by) take a share of each one's time (that load over
their number and the highest prefill rate any worker measured: the same model on the same GPUs, and
chunks under a step budget read slower than whole prompts) and lengthen its steps to decode step /
(1 - share); their KV use and batches spread over one more worker. Asked by the decode pool, the move
is made only if that predicted decode pressure is below today's; asked by a pressed prefill pool (no
GPU for another prefill worker, no idle decode worker to take), only if it stays below `scale_up_at`:
every worker then prefills, as colocated replicas do. The steps are not credited with the smaller
batch (a decode step's time by batch is not measured): where the steps alone press the decode pool the
move is refused, as it should be when they are bound by the weights' reads, which a smaller batch does
not shorten.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.api import WorkerStatsMsg

__all__ = ["AutoscalerConfig", "Autoscaler", "Decision", "PromptLoad", "pressures", "decode_pressure_computing_prompts"]


class AutoscalerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_ms: float = Field(gt=0, description="The TTFT SLO the prefill pool is sized for.")
    tpot_ms: float = Field(gt=0, description="The TPOT SLO the decode pool is sized for.")
    max_gpus: int = Field(ge=1, description="Most GPUs all pools may take together.")
    min_prefill: int = Field(1, ge=0, description="0: the prefill pool may give its last worker to decoding (when the "
                             "decode pool is pressed; it never just leaves); the decode workers then compute every "
                             "prompt, as colocated workers do.")
    max_prefill: int = Field(64, ge=0)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(64, ge=1)
    ttft_queue_share: float = Field(0.5, gt=0, le=1, description="Of the TTFT SLO, what queueing may take.")
    max_kv_use: float = Field(0.9, gt=0, le=1, description="Decode KV use that counts as full.")
    scale_up_at: float = Field(1.0, gt=0, description="Pressure above which a pool grows.")
    scale_down_at: float = Field(0.3, ge=0, description="Pressure below which a pool shrinks.")
    sustain_s: float = Field(10.0, ge=0, description="How long a pressure must last before it moves anything.")
    cooldown_s: float = Field(30.0, ge=0, description="No change for this long after one.")

    @model_validator(mode="after")
    def _check(self) -> AutoscalerConfig:
        if self.scale_down_at >= self.scale_up_at:
            raise ValueError(f"scale_down_at ({self.scale_down_at}) must be below scale_up_at ({self.scale_up_at}): "
                             "the gap between them is what keeps the autoscaler from flapping")
        return self


@dataclass(frozen=True)
class Decision:
    at_s: float
    pool: str  # "prefill" or "decode"
    num_workers: int  # the pool's new size
    why: str
    flip_to: str | None = None  # a worker of `pool` changes role to this pool (which grows by one)


def pressures(stats: Sequence[WorkerStatsMsg], config: AutoscalerConfig, no_prefill_pool: bool = False,
              prompt_tokens_per_s: float | None = None) -> dict[str, float | None]:
    """Per pool, its pressure (None: no worker of it reported a measured speed yet). With no prefill
    worker (`no_prefill_pool`) the decode workers compute every prompt: their prompt queues are the
    prefill pool's pressure then, so that it can grow back from none. prompt_tokens_per_s: the prompt
    load arriving (PromptLoad), which a prefill pool's measured rates must keep up with."""
    decode = _decode_workers(stats)
    computing = decode if no_prefill_pool else [s for s in stats if s.role == "prefill"]
    prefill = [s for s in computing if s.prefill_tokens_per_s > 0]
    out: dict[str, float | None] = {"prefill": None, "decode": None}
    if prefill:
        wait_s = max(s.num_queued_prompt_tokens / s.prefill_tokens_per_s for s in prefill)
        level = wait_s / (config.ttft_queue_share * config.ttft_ms / 1e3)
        if prompt_tokens_per_s is not None and not no_prefill_pool:
            use = prompt_tokens_per_s / sum(s.prefill_tokens_per_s for s in prefill)
            if use > 1.0:  # NOTE: overloaded only; below 1 the queue says how near the SLO it is (and when idle)
                level = max(level, use)
        out["prefill"] = level
    if decode:
        kv, step, batch = _decode_levels(decode, config)
        out["decode"] = max(kv, step, batch)
    return out


def _decode_workers(stats: Sequence[WorkerStatsMsg]) -> list[WorkerStatsMsg]:
    """The decode workers that reported a KV cache."""
    return [s for s in stats if s.role == "decode" and s.num_blocks > 0]


def _decode_levels(decode: Sequence[WorkerStatsMsg], config: AutoscalerConfig) -> tuple[float, float, float]:
    """The decode pool's KV, step and batch pressures."""
    kv = max((s.num_blocks - s.num_free_blocks) / s.num_blocks for s in decode) / config.max_kv_use
    step = max(s.decode_step_s for s in decode) / (config.tpot_ms / 1e3)
    # NOTE: past 1 only with requests waiting for a full batch (max_num_seqs): they wait in TPOT and TTFT
    batch = max(((s.num_running + s.num_waiting) / s.max_num_seqs for s in decode if s.max_num_seqs), default=0.0)
    return kv, step, batch


def decode_pressure_computing_prompts(stats: Sequence[WorkerStatsMsg], config: AutoscalerConfig,
                                      prompt_tokens_per_s: float, num_decode: int) -> float | None:
    """The decode pool's predicted pressure once `num_decode` decode workers compute every prompt as well
    (the module docstring's model); None: no decode worker or prefill rate measured yet."""
    decode = _decode_workers(stats)
    rate = max((s.prefill_tokens_per_s for s in stats), default=0.0)
    if not decode or rate <= 0:
        return None
    share = prompt_tokens_per_s / (num_decode * rate)
    if share >= 1.0:
        return math.inf
    kv, step, batch = _decode_levels(decode, config)
    spread = len(decode) / num_decode
    return max(kv * spread, step / (1.0 - share), batch * spread)


class PromptLoad:
    """The prompt tokens a second that arrived at all workers together over about the last `window_s`: what
    they computed (WorkerStatsMsg.num_prompt_tokens_computed, a counter) plus what their queues grew by
    (num_queued_prompt_tokens), so a saturated prefill worker does not hide the load past its speed;
    over the workers that reported at both ends: one that joins or leaves adds nothing."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, int]]] = deque()

    def observe(self, now_s: float, stats: Sequence[WorkerStatsMsg]) -> None:
        self._samples.append((now_s, {s.worker_id: s.num_prompt_tokens_computed + s.num_queued_prompt_tokens
                                      for s in stats}))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def tokens_per_s(self) -> float | None:
        """None: fewer than two reports yet."""
        if len(self._samples) < 2:
            return None
        (start_s, first), (end_s, last) = self._samples[0], self._samples[-1]
        if end_s <= start_s:
            return None
        return max(0, sum(last[w] - first[w] for w in last.keys() & first.keys())) / (end_s - start_s)


class Autoscaler:
    def __init__(self, config: AutoscalerConfig, gpus_per_worker: Mapping[str, int],
                 shrinkable: frozenset[str] = frozenset({"prefill", "decode"})) -> None:
        """gpus_per_worker: per pool, a worker's GPUs (its tensor-parallel size). shrinkable: the pools
        that can drain a worker (a colocated pool cannot refuse the router's requests, so it only grows)."""
        self.config = config
        self.gpus_per_worker = dict(gpus_per_worker)
        self.shrinkable = shrinkable
        self.decisions: deque[Decision] = deque(maxlen=100)
        self._since: dict[tuple[str, str], float] = {}  # (pool, "up"/"down") -> when the condition began
        self._last_change_s = -float("inf")
        self.prompt_load = PromptLoad(config.sustain_s)

    def decide(self, now_s: float, sizes: Mapping[str, int], stats: Sequence[WorkerStatsMsg],
               releasable: frozenset[str] | None = None) -> Decision | None:
        """The one change to make now, if any. sizes: each pool's serving workers now. releasable: the pools
        whose newest worker gives back what it holds when retired (None: every pool)."""
        c = self.config
        self.prompt_load.observe(now_s, stats)
        load = self.prompt_load.tokens_per_s()
        levels = pressures(stats, c, no_prefill_pool=sizes.get("prefill") == 0, prompt_tokens_per_s=load)
        wants: list[tuple[float, str, str]] = []  # (how far past the threshold, pool, direction)
        for pool, level in levels.items():
            if pool not in sizes:
                continue
            for direction, held in (("up", level is not None and level > c.scale_up_at),
                                    ("down", level is not None and level < c.scale_down_at)):
                key = (pool, direction)
                if not held:
                    self._since.pop(key, None)
                    continue
                start = self._since.setdefault(key, now_s)
                if now_s - start >= c.sustain_s:
                    assert level is not None
                    wants.append((level - c.scale_up_at if direction == "up" else c.scale_down_at - level,
                                  pool, direction))
        if not wants or now_s - self._last_change_s < c.cooldown_s:
            return None
        for _, pool, direction in sorted(wants, reverse=True):
            decision = self._change(now_s, pool, direction, sizes, levels, releasable)
            if decision is not None and not self._admits(decision, pool == "prefill" and direction == "up", sizes,
                                                         levels, stats, load):
                continue
            if decision is not None:
                self._last_change_s = now_s
                self._since.clear()
                self.decisions.append(decision)
                return decision
        return None

    def _admits(self, decision: Decision, for_prefill: bool, sizes: Mapping[str, int],
                levels: Mapping[str, float | None], stats: Sequence[WorkerStatsMsg], load: float | None) -> bool:
        """Whether a move of the last prefill worker to decoding is predicted to do what it is for (the module
        docstring's model, with the prompt `load`): for the decode pool's pressure, lower it; for the prefill
        pool's (`for_prefill`), keep the decode pool under `scale_up_at`. Any other change passes. With no
        prediction (nothing measured yet) the decode pool's move passes and the prefill pool's does not."""
        if not (decision.pool == "prefill" and decision.flip_to == "decode" and decision.num_workers == 0):
            return True
        now = levels.get("decode")
        after = None if load is None else decode_pressure_computing_prompts(stats, self.config, load,
                                                                            sizes["decode"] + 1)
        if for_prefill:
            return after is not None and after < self.config.scale_up_at
        return after is None or now is None or after < now

    def _change(self, now_s: float, pool: str, direction: str, sizes: Mapping[str, int],
                levels: Mapping[str, float | None], releasable: frozenset[str] | None = None) -> Decision | None:
        c = self.config
        low, high = (c.min_prefill, c.max_prefill) if pool == "prefill" else (c.min_decode, c.max_decode)
        level = levels[pool]
        other = "decode" if pool == "prefill" else "prefill"
        other_level = levels.get(other)
        if direction == "down":
            if sizes[pool] - 1 < low or pool not in self.shrinkable:
                return None
            other_high = c.max_decode if other == "decode" else c.max_prefill
            if other in sizes and other_level is not None and other_level > c.scale_up_at and sizes[other] < other_high:
                # NOTE: the other pool is pressed: the idle worker moves to it rather than leaving
                return Decision(now_s, pool, sizes[pool] - 1, f"{pool} pressure {level:.2f} < {c.scale_down_at} for "
                                f"{c.sustain_s:.0f} s; {other} pressure {other_level:.2f}: a {pool} worker becomes a "
                                f"{other} worker", flip_to=other)
            if sizes[pool] == 1:  # NOTE: a pool's last worker goes only to the other pool (min_prefill 0), never away
                return None
            if releasable is not None and pool not in releasable:
                return None
            return Decision(now_s, pool, sizes[pool] - 1, f"{pool} pressure {level:.2f} < {c.scale_down_at} for "
                            f"{c.sustain_s:.0f} s")
        if sizes[pool] + 1 > high:
            return None
        used = sum(n * self.gpus_per_worker.get(p, 1) for p, n in sizes.items())
        if used + self.gpus_per_worker.get(pool, 1) <= c.max_gpus:
            return Decision(now_s, pool, sizes[pool] + 1, f"{pool} pressure {level:.2f} > {c.scale_up_at} for "
                            f"{c.sustain_s:.0f} s")
        other_low = c.min_decode if other == "decode" else c.min_prefill
        if (other in sizes and other in self.shrinkable and other_level is not None and other_level < c.scale_down_at
                and sizes[other] > other_low):
            # NOTE: at the GPU budget: a worker of the idle pool changes role
            return Decision(now_s, other, sizes[other] - 1, f"{pool} pressure {level:.2f} > {c.scale_up_at} at the "
                            f"GPU budget ({c.max_gpus}); {other} pressure {other_level:.2f}: a {other} worker becomes "
                            f"a {pool} worker", flip_to=pool)
        if (pool == "prefill" and sizes[pool] == 1 and c.min_prefill == 0 and "decode" in sizes
                and sizes["decode"] < c.max_decode and "prefill" in self.shrinkable):
            # NOTE: no GPU and no idle decode worker for another prefill worker: every worker prefills instead
            # (0P), if the decode workers can take the prompts within the TPOT SLO (Autoscaler._admits)
            return Decision(now_s, pool, 0, f"prefill pressure {level:.2f} > {c.scale_up_at} at the GPU budget "
                            f"({c.max_gpus}), decode pressure {other_level or 0:.2f}: the prefill worker becomes a "
                            "decode worker and every worker computes prompts, within the TPOT SLO as predicted",
                            flip_to="decode")
        return None


async def autoscale_once(autoscaler: Autoscaler, now_s: float, sizes: Mapping[str, int],
                         stats: Sequence[WorkerStatsMsg], apply: object,
                         releasable: frozenset[str] | None = None) -> Decision | None:
    """One round of the controller's loop: decide, then `await apply(decision)` (the controller
    resizes the pool, or moves a worker between pools: it drains what it retires or moves)."""
    decision = autoscaler.decide(now_s, sizes, stats, releasable)
    if decision is not None:
        await apply(decision)  # type: ignore[operator]
    return decision
