"""The joint prefill/decode autoscaler: from the workers' stats against the SLOs, one change at a time
to the pools' sizes, within per-pool bounds and a GPU budget, without flapping.

Per pool, a pressure in [0, inf] where 1 means "at the SLO":
  prefill  the largest of three: two queue waits over the TTFT SLO's share for queueing
           (`ttft_queue_share`), the longest predicted wait of the prompts queued now (queued prompt
           tokens / measured prefill rate) and the p90 wait the prompts arriving (`PromptLoad`: tokens
           a second and their mean length over the last `sustain_s`) meet at the pool's measured rates
           (`arrivals_queue_pressure`: each worker an M/D/1 queue of its share; inf once they arrive
           faster than the pool computes); and the first tokens the routers saw later than the TTFT SLO
           over their last 10 s (`TtftCounts`, at least `min_first_tokens` of them) over the 10% the
           SLO's p90 allows: what neither model sees (a prompt's own prefill and push under a tight
           TTFT SLO, stalls) it measures. Queue waits alone rise and fall with bursts of long
           prompts: on 2x H200 at 20 req/s of 1-4k-token prompts the queue's pressure stayed past 1
           for no 10 s together, and the move to two workers that prefill came only at 24 req/s. The
           arrivals' and the first tokens' pressures are already averages over about `sustain_s`: past
           `scale_up_at` they move the pool at once, not `sustain_s` later (a step of load would
           otherwise wait twice as long).
  decode   the largest of the KV use (held / all blocks) over `max_kv_use`, the measured decode
           step time over the TPOT SLO, and the requests running and waiting over the running
           batch's cap (max_num_seqs): a decode worker whose batch is full and requests wait is
           pressed though its steps are quick and its KV has room.
A pool above `scale_up_at` for `sustain_s` grows by one worker (when the budget allows; otherwise, in
disaggregated mode, a worker of the other pool changes role to it if that pool is below
`scale_down_at`: drained, it flips in place, keeping its engine: cluster/flex_worker.py); a pool below
`scale_down_at` for `sustain_s` shrinks by one (never under its minimum), its worker moving to the other
pool instead of leaving when that pool is above `scale_up_at` then. A shrink that moves no worker is
made only where it gives something back (`releasable`: the newest worker sits on a GPU bundle its pool
grew, or on none): the GPUs of a pool's start group stay reserved whatever runs on them, so retiring a
worker there would only cost the start of the next one. After any change, nothing changes for
`cooldown_s`: the hysteresis between the two thresholds and the cooldown are what keep it from flapping.
Every decision, and why, is kept (`decisions`) for `pdserve status`.

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

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.api import WorkerStatsMsg

__all__ = ["AutoscalerConfig", "Autoscaler", "Decision", "PressureSample", "PromptLoad", "TtftCounts", "pressures",
           "prefill_terms", "arrivals_queue_pressure", "decode_pressure_computing_prompts"]

TTFT_MISS_ALLOWED = 0.1
"""Of the first tokens, the share the TTFT SLO (a p90 target) lets come later than it."""


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
    min_first_tokens: int = Field(20, ge=1, description="Fewest first tokens the routers' TTFT counts must hold "
                                  "to press the prefill pool.")

    @model_validator(mode="after")
    def _check(self) -> AutoscalerConfig:
        if self.scale_down_at >= self.scale_up_at:
            raise ValueError(f"scale_down_at ({self.scale_down_at}) must be below scale_up_at ({self.scale_up_at}): "
                             "the gap between them is what keeps the autoscaler from flapping")
        return self


class TtftCounts(NamedTuple):
    """The routers' first tokens over their last window, and how many came later than the TTFT SLO (the
    cluster controller sums their TtftCountsMsg)."""

    num_first_tokens: int
    num_over_slo: int


class PressureSample(NamedTuple):
    """One autoscaler round as it read the cluster (`Autoscaler.trace`; `pdserve status --trace`)."""

    at_s: float
    num_prefill: int
    num_decode: int
    prefill: float | None  # the pools' pressures (pressures())
    decode: float | None
    prefill_queue: float | None  # the prefill pressure's terms (prefill_terms())
    prefill_arrivals: float | None
    prefill_late_first_tokens: float | None
    prompt_tokens_per_s: float | None
    mean_prompt_tokens: float | None


@dataclasses.dataclass(frozen=True)
class Decision:
    at_s: float
    pool: str  # "prefill" or "decode"
    num_workers: int  # the pool's new size
    why: str
    flip_to: str | None = None  # a worker of `pool` changes role to this pool (which grows by one)


def pressures(stats: Sequence[WorkerStatsMsg], config: AutoscalerConfig, no_prefill_pool: bool = False,
              prompt_tokens_per_s: float | None = None, mean_prompt_tokens: float | None = None,
              ttft: TtftCounts | None = None) -> dict[str, float | None]:
    """Per pool, its pressure (None: no worker of it reported a measured speed yet). With no prefill
    worker (`no_prefill_pool`) the decode workers compute every prompt: their prompt queues are the
    prefill pool's pressure then, so that it can grow back from none. prompt_tokens_per_s and
    mean_prompt_tokens: the prompts arriving (PromptLoad), whose queue at the prefill pool's measured
    rates counts as well (arrivals_queue_pressure); ttft: the routers' first tokens against the SLO."""
    return _levels(stats, config, prefill_terms(stats, config, no_prefill_pool, prompt_tokens_per_s,
                                                mean_prompt_tokens, ttft))


def _levels(stats: Sequence[WorkerStatsMsg], config: AutoscalerConfig,
            terms: tuple[float, float | None, float | None] | None) -> dict[str, float | None]:
    """pressures(), from the prefill pool's terms (prefill_terms)."""
    decode = _decode_workers(stats)
    out: dict[str, float | None] = {"prefill": None, "decode": None}
    if terms is not None:
        out["prefill"] = max(terms[0], terms[1] or 0.0, terms[2] or 0.0)
    if decode:
        kv, step, batch = _decode_levels(decode, config)
        out["decode"] = max(kv, step, batch)
    return out


def prefill_terms(stats: Sequence[WorkerStatsMsg], config: AutoscalerConfig, no_prefill_pool: bool,
                  prompt_tokens_per_s: float | None, mean_prompt_tokens: float | None,
                  ttft: TtftCounts | None = None) -> tuple[float, float | None, float | None] | None:
    """The prefill pool's three pressures (the module docstring's): its queues' now, the arrivals' and the
    first tokens' (each None: not measured yet, too few, or no prefill pool); None: no worker that
    computes prompts has measured its rate."""
    computing = _decode_workers(stats) if no_prefill_pool else [s for s in stats if s.role == "prefill"]
    prefill = [s for s in computing if s.prefill_tokens_per_s > 0]
    if not prefill:
        return None
    wait_s = max(s.num_queued_prompt_tokens / s.prefill_tokens_per_s for s in prefill)
    queue = wait_s / (config.ttft_queue_share * config.ttft_ms / 1e3)
    arriving = None if no_prefill_pool else arrivals_queue_pressure(
        [s.prefill_tokens_per_s for s in prefill], config, prompt_tokens_per_s, mean_prompt_tokens)
    late = None
    if not no_prefill_pool and ttft is not None and ttft.num_first_tokens >= config.min_first_tokens:
        late = ttft.num_over_slo / ttft.num_first_tokens / TTFT_MISS_ALLOWED
    return queue, arriving, late


def arrivals_queue_pressure(rates: Sequence[float], config: AutoscalerConfig, prompt_tokens_per_s: float | None,
                            mean_prompt_tokens: float | None) -> float | None:
    """The p90 queue wait of prompts arriving at `prompt_tokens_per_s`, `mean_prompt_tokens` long, at
    prefill workers of these measured `rates` (tokens a second), over the TTFT SLO's share for queueing.
    Each worker is taken as an M/D/1 queue of its share of the arrivals (the router sends each prompt to
    the soonest, so waits are no longer than that): utilization u, service time S of a mean prompt, mean
    wait Wq = u S / (2 (1 - u)), and P(wait > t) ~ u exp(-u t / Wq) (the heavy-traffic tail), so
    p90 = Wq ln(10 u) / u (0 below u = 0.1). inf from u >= 1: the queues grow without end. None: no
    load or no mean length measured yet (before, only arrivals past the rates counted: the pressure
    was their ratio)."""
    if not rates or prompt_tokens_per_s is None:
        return None
    total = sum(rates)
    use = prompt_tokens_per_s / total
    if use >= 1.0:
        return math.inf
    if mean_prompt_tokens is None or use <= 0.1:
        return None if mean_prompt_tokens is None else 0.0
    service_s = mean_prompt_tokens * len(rates) / total
    mean_wait_s = use * service_s / (2.0 * (1.0 - use))
    return mean_wait_s * math.log(10.0 * use) / use / (config.ttft_queue_share * config.ttft_ms / 1e3)


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
    (num_queued_prompt_tokens), so a saturated prefill worker does not hide the load past its speed; and
    the mean prompt's length (tokens computed over prompts started, num_prompts_started); over the workers
    that reported at both ends: one that joins or leaves adds nothing."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # per report: its time and, per worker, (tokens arrived, tokens computed, prompts started)
        self._samples: deque[tuple[float, dict[str, tuple[int, int, int]]]] = deque()

    def observe(self, now_s: float, stats: Sequence[WorkerStatsMsg]) -> None:
        self._samples.append((now_s, {s.worker_id: (s.num_prompt_tokens_computed + s.num_queued_prompt_tokens,
                                                    s.num_prompt_tokens_computed, s.num_prompts_started)
                                      for s in stats}))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def span_s(self) -> float:
        """The seconds the window covers now (0.0: fewer than two reports)."""
        return self._samples[-1][0] - self._samples[0][0] if len(self._samples) >= 2 else 0.0

    def _grown(self, index: int) -> int:
        (_, first), (_, last) = self._samples[0], self._samples[-1]
        return max(0, sum(last[w][index] - first[w][index] for w in last.keys() & first.keys()))

    def tokens_per_s(self) -> float | None:
        """None: fewer than two reports yet."""
        span = self.span_s()
        return self._grown(0) / span if span > 0 else None

    def mean_prompt_tokens(self) -> float | None:
        """None: no prompt started within the window."""
        if self.span_s() <= 0 or (started := self._grown(2)) == 0:
            return None
        return self._grown(1) / started


def _prefill_detail(terms: tuple[float, float | None, float | None], load: float | None, mean_prompt: float | None,
                    ttft: TtftCounts | None) -> str:
    """What the prefill pool's pressure was made of, for a decision's why."""
    queue, arriving, late = terms
    text = f"prefill queue {queue:.2f}, arrivals {'unmeasured' if arriving is None else f'{arriving:.2f}'}"
    if load is not None:
        text += f": {load:.0f} prompt tokens a second"
        if mean_prompt is not None:
            text += f" of {mean_prompt:.0f}-token prompts"
    if late is not None and ttft is not None:
        text += f"; late first tokens {late:.2f}: {ttft.num_over_slo} of {ttft.num_first_tokens} past the TTFT SLO"
    return text


class Autoscaler:
    def __init__(self, config: AutoscalerConfig, gpus_per_worker: Mapping[str, int],
                 shrinkable: frozenset[str] = frozenset({"prefill", "decode"})) -> None:
        """gpus_per_worker: per pool, a worker's GPUs (its tensor-parallel size). shrinkable: the pools
        that can drain a worker (a colocated pool cannot refuse the router's requests, so it only grows)."""
        self.config = config
        self.gpus_per_worker = dict(gpus_per_worker)
        self.shrinkable = shrinkable
        self.decisions: deque[Decision] = deque(maxlen=100)
        # moves wanted but not made (Autoscaler._refusal), at most one per pool and direction a cooldown
        self.held_back: deque[Decision] = deque(maxlen=20)
        self.trace: deque[PressureSample] = deque(maxlen=1200)  # every round's reading: 20 min at one a second
        self._since: dict[tuple[str, str], float] = {}  # (pool, "up"/"down") -> when the condition began
        self._last_change_s = -float("inf")
        self.prompt_load = PromptLoad(config.sustain_s)

    def decide(self, now_s: float, sizes: Mapping[str, int], stats: Sequence[WorkerStatsMsg],
               releasable: frozenset[str] | None = None, ttft: TtftCounts | None = None) -> Decision | None:
        """The one change to make now, if any. sizes: each pool's serving workers now. releasable: the pools
        whose newest worker gives back what it holds when retired (None: every pool). ttft: the routers'
        first tokens against the TTFT SLO (None: no router reported)."""
        c = self.config
        self.prompt_load.observe(now_s, stats)
        load = self.prompt_load.tokens_per_s()
        no_prefill_pool = sizes.get("prefill") == 0
        mean_prompt = self.prompt_load.mean_prompt_tokens()
        terms = prefill_terms(stats, c, no_prefill_pool, load, mean_prompt, ttft)
        levels = _levels(stats, c, terms)  # NOTE: pressures(), its terms computed once for both
        queued, arriving, late = terms if terms is not None else (None, None, None)
        self.trace.append(PressureSample(now_s, sizes.get("prefill", 0), sizes.get("decode", 0), levels["prefill"],
                                         levels["decode"], queued, arriving, late, load, mean_prompt))
        # NOTE: the arrivals' and the first tokens' pressures are averages over about sustain_s already
        averaged_up = (arriving is not None and arriving > c.scale_up_at and self.prompt_load.span_s() >= c.sustain_s) \
            or (late is not None and late > c.scale_up_at)
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
                if (pool, direction) == ("prefill", "up") and averaged_up:
                    start = now_s - c.sustain_s
                if now_s - start >= c.sustain_s:
                    assert level is not None
                    wants.append((level - c.scale_up_at if direction == "up" else c.scale_down_at - level,
                                  pool, direction))
        if not wants or now_s - self._last_change_s < c.cooldown_s:
            return None
        for _, pool, direction in sorted(wants, reverse=True):
            decision = self._change(now_s, pool, direction, sizes, levels, releasable)
            if decision is not None and terms is not None and pool == "prefill":  # NOTE: moved by that pressure
                detail = _prefill_detail(terms, load, mean_prompt, ttft)
                decision = dataclasses.replace(decision, why=f"{decision.why} ({detail})")
            refusal = None if decision is None else self._refusal(decision, pool == "prefill" and direction == "up",
                                                                   sizes, levels, stats, load)
            if decision is not None and refusal is not None:
                self._hold_back(decision, refusal)
                continue
            if decision is not None:
                self._last_change_s = now_s
                self._since.clear()
                self.decisions.append(decision)
                return decision
        return None

    def _refusal(self, decision: Decision, for_prefill: bool, sizes: Mapping[str, int],
                 levels: Mapping[str, float | None], stats: Sequence[WorkerStatsMsg], load: float | None) -> str | None:
        """Why a move of the last prefill worker to decoding is predicted not to do what it is for (the module
        docstring's model, with the prompt `load`), or None to make it: for the decode pool's pressure, it must
        lower it; for the prefill pool's (`for_prefill`), keep the decode pool under `scale_up_at`. Any other
        change is made. With no prediction (nothing measured yet) the decode pool's move is made and the
        prefill pool's is not."""
        if not (decision.pool == "prefill" and decision.flip_to == "decode" and decision.num_workers == 0):
            return None
        now = levels.get("decode")
        after = None if load is None else decode_pressure_computing_prompts(stats, self.config, load,
                                                                            sizes["decode"] + 1)
        if after is None:
            return "no prompt load or prefill rate measured yet to predict it from" if for_prefill else None
        limit = self.config.scale_up_at if for_prefill else now
        if limit is None or after < limit:
            return None
        return (f"predicted decode pressure {after:.2f} >= {limit:.2f} once {sizes['decode'] + 1} workers compute "
                f"{load:.0f} prompt tokens a second as well")

    def _hold_back(self, decision: Decision, refusal: str) -> None:
        """Keeps a move not made, and why, for `pdserve status`: once per pool and direction a cooldown."""
        for held in reversed(self.held_back):
            if held.pool == decision.pool and held.flip_to == decision.flip_to:
                if decision.at_s - held.at_s < self.config.cooldown_s:
                    return
                break
        self.held_back.append(dataclasses.replace(decision, why=f"not made: {decision.why}; {refusal}"))

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
            # (0P), if the decode workers can take the prompts within the TPOT SLO (Autoscaler._refusal)
            return Decision(now_s, pool, 0, f"prefill pressure {level:.2f} > {c.scale_up_at} at the GPU budget "
                            f"({c.max_gpus}), decode pressure {other_level or 0:.2f}: the prefill worker becomes a "
                            "decode worker and every worker computes prompts, within the TPOT SLO as predicted",
                            flip_to="decode")
        return None


async def autoscale_once(autoscaler: Autoscaler, now_s: float, sizes: Mapping[str, int],
                         stats: Sequence[WorkerStatsMsg], apply: object,
                         releasable: frozenset[str] | None = None, ttft: TtftCounts | None = None) -> Decision | None:
    """One round of the controller's loop: decide, then `await apply(decision)` (the controller
    resizes the pool, or moves a worker between pools: it drains what it retires or moves)."""
    decision = autoscaler.decide(now_s, sizes, stats, releasable, ttft)
    if decision is not None:
        await apply(decision)  # type: ignore[operator]
    return decision
