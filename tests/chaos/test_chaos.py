"""Chaos on a local Ray cluster over gloo (2 prefill + 2 decode workers, fault transport): under 32
concurrent streaming requests (half greedy, half seeded sampled, a quarter of each under a JSON
schema), kill a decode worker, kill a prefill worker, and inject each transfer fault (drop, delay
past the deadline, fail). Each time:
every request completes with exactly the fault-free tokens (a moved seeded request too: its draws
depend on its seed and output position only), or ends with a clear error; new requests are served
within 10 s of the fault, the controller replaces dead workers, and no worker holds a block once
drained. The figures go to bench/results/chaos_cpu.json (merged per scenario) when
PDSERVE_WRITE_RESULTS=1."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from decode_worker import DecodeWorkerConfig
from prefill_worker import PrefillWorkerConfig
from cluster.config import ClusterConfig
from engine import LLM, SamplingParams
from engine.config import GrammarSpec
from engine.llm import engine_config
from kvtransfer.fault import FaultRule
from router.dispatch import DispatcherConfig, LocalPrefillConfig
from tests.chaos.harness import Chaos, Outcome, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.integration]

ENGINE = dict(device="cpu", block_size=8, num_blocks=256)
NUM_REQUESTS = 32
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
PROBE_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TRANSFER_TIMEOUT_S = 2.0
MAX_RECOVERY_S = 10.0
CLUSTER = ClusterConfig(
    engine=engine_config(**ENGINE), mode="disaggregated", num_prefill=2, num_decode=2, transport="gloo",
    prefill=PrefillWorkerConfig(transfer_timeout_s=TRANSFER_TIMEOUT_S),
    decode=DecodeWorkerConfig(transfer_timeout_s=TRANSFER_TIMEOUT_S, lease_ttl_s=10.0),
)
DISPATCH = DispatcherConfig(
    max_capacity_wait_s=5.0, call_timeout_s=10.0, stall_timeout_s=30.0, prefill_timeout_s=60.0,
    failed_worker_cooldown_s=5.0,
    local_prefill=LocalPrefillConfig(rule="remote"),  # NOTE: these prompts are short; the faults are the KV push's
)
RESULTS_PATH = Path(__file__).resolve().parents[2] / "bench" / "results" / "chaos_cpu.json"


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


PROMPTS = _prompts(NUM_REQUESTS)
# A JSON schema on a quarter of them: a moved request's matcher is rebuilt from its output so far.
SCHEMA = GrammarSpec(kind="json_schema", text=json.dumps({
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}},
    "required": ["id", "tags"]}))
# NOTE: in pairs, not alternately: requests may be spread over the two decode workers alternately.
PARAMS = [
    (GREEDY if i % 4 < 2 else SEEDED.model_copy(update={"seed": 1000 + i})).model_copy(
        update={"grammar": SCHEMA if i % 8 in (0, 2) else None})
    for i in range(NUM_REQUESTS)
]
PROBE = _prompts(1, seed=99)[0]


class Runner:
    """The cluster and the event loop it lives on, shared by this module's scenarios."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.chaos = Chaos(CLUSTER, DISPATCH)
        llm = LLM(**ENGINE)
        self.expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        self.expected_probe = llm.generate([PROBE], PROBE_PARAMS)[0].outputs[0].token_ids
        self.results: dict[str, dict[str, Any]] = {}

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def runner(ray_cluster: None) -> Iterator[Runner]:
    r = Runner()
    started = time.monotonic()
    r.run(r.chaos.start())
    r.run(r.chaos.wait_full_and_drained())
    startup_s = time.monotonic() - started
    try:
        yield r
    finally:
        r.run(r.chaos.stop())
        r.loop.close()
        _write_results(r.results, startup_s)


def _write_results(scenarios: dict[str, dict[str, Any]], startup_s: float) -> None:
    """Records the figures only when asked (PDSERVE_WRITE_RESULTS=1): a plain test run leaves the
    committed results alone."""
    if not scenarios or os.environ.get("PDSERVE_WRITE_RESULTS") != "1":
        return
    old = json.loads(RESULTS_PATH.read_text()) if RESULTS_PATH.is_file() else {}
    merged = {**old.get("scenarios", {}), **scenarios}
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps({
        "what": "chaos on a local Ray cluster (CPU, gloo under the fault transport): 32 concurrent streaming "
                "requests per scenario (half greedy, half seeded sampled; a quarter of each under a JSON schema); "
                "recovery_s = from the fault to the "
                "first new request served in full",
        "goal_recovery_s": MAX_RECOVERY_S,
        "environment": {
            "device": "cpu", "num_cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch_version": torch.__version__, "ray_version": ray.__version__,
            "python_version": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "cluster": {
            "num_prefill": CLUSTER.num_prefill, "num_decode": CLUSTER.num_decode, "engine": ENGINE,
            "transfer_timeout_s": TRANSFER_TIMEOUT_S, "max_tokens": GREEDY.max_tokens, "startup_s": round(startup_s, 2),
            "dispatcher": DISPATCH.model_dump(),
        },
        "scenarios": merged,
    }, indent=2) + "\n")


async def _scenario(
    r: Runner,
    inject: Callable[[list[Outcome]], Awaitable[float]],
    prepare: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Runs the 32 requests with a fault injected by `inject` (which returns its time.time()),
    checks the invariants, and returns the figures."""
    chaos = r.chaos
    assert chaos.dispatcher is not None
    await chaos.wait_full_and_drained()
    migrations_before = chaos.dispatcher.num_migrations
    if prepare is not None:
        await prepare()
    outcomes = [Outcome() for _ in PROMPTS]
    started = time.time()
    tasks = [asyncio.ensure_future(chaos.generate(p, sp, o)) for p, sp, o in zip(PROMPTS, PARAMS, outcomes)]
    fault_at = await inject(outcomes)
    served_at = await chaos.probe_until_served(PROBE, PROBE_PARAMS)
    await asyncio.wait_for(asyncio.gather(*tasks), 180.0)
    all_done_at = max(o.finished_at for o in outcomes)
    held = await chaos.wait_full_and_drained()
    whole_at = time.time()

    errors = [f"{type(o.error).__name__}: {o.error}" for o in outcomes if o.error is not None]
    wrong = [i for i, o in enumerate(outcomes) if o.error is None and o.tokens != r.expected[i]]
    assert not wrong, f"requests {wrong} did not give the fault-free tokens"
    assert set(held.values()) == {0}, held
    # The longest silence, across the fault, of a stream that was under way when it came.
    pauses = [max(b - a for a, b in zip(o.token_times, o.token_times[1:]) if b >= fault_at)
              for o in outcomes if o.token_times and o.token_times[0] < fault_at < o.token_times[-1]]
    figures = {
        "recovery_s": round(served_at - fault_at, 3),
        "max_stream_pause_s": round(max(pauses, default=0.0), 3),
        "fault_after_start_s": round(fault_at - started, 3),
        "all_requests_done_after_fault_s": round(all_done_at - fault_at, 3),
        "cluster_whole_and_drained_after_fault_s": round(whole_at - fault_at, 3),
        "num_requests": len(outcomes),
        "num_exact": len(outcomes) - len(errors),
        "num_clear_errors": len(errors),
        "errors": errors[:5],
        "num_migrations": chaos.dispatcher.num_migrations - migrations_before,
        "held_blocks_after_drain": held,
    }
    return figures


def _kill_a_decode_worker_when(r: Runner, condition: Callable[[list[Outcome]], bool]
                               ) -> Callable[[list[Outcome]], Awaitable[float]]:
    async def inject(outcomes: list[Outcome]) -> float:
        await wait_until(lambda: condition(outcomes), 120.0, "streams ready for the decode kill")
        handles = r.chaos.handles("decode")
        # NOTE: the decode worker streaming the most requests now, so the kill lands mid-stream
        # (the first one listed may have finished all of its own by then: nothing to migrate).
        assert r.chaos.dispatcher is not None
        streaming = r.chaos.dispatcher.num_streaming()
        victim_id = max(handles, key=lambda worker_id: streaming.get(worker_id, 0))
        ray.kill(handles[victim_id], no_restart=True)
        return time.time()

    return inject


def _check(r: Runner, name: str, figures: dict[str, Any], min_migrations: int) -> None:
    r.results[name] = figures
    print(f"\n{name}: {json.dumps(figures)}")
    assert figures["num_migrations"] >= min_migrations, figures
    assert figures["recovery_s"] < MAX_RECOVERY_S, figures
    assert figures["num_exact"] >= 0.9 * NUM_REQUESTS, figures  # the rest ended with a clear error


def test_kill_a_decode_worker_mid_stream(runner: Runner) -> None:
    inject = _kill_a_decode_worker_when(runner, lambda outs: sum(len(o.tokens) >= 3 for o in outs) >= NUM_REQUESTS - 4)
    figures = runner.run(_scenario(runner, inject))
    _check(runner, "kill_decode_worker", figures, min_migrations=1)


def _kill_the_busiest_prefill_worker(r: Runner) -> Callable[[list[Outcome]], Awaitable[float]]:
    """Once the first tokens stream, kills the prefill worker holding the most prompt jobs (queued,
    computing or pushing): the kill lands mid-prefill, so those requests must start again elsewhere."""
    async def inject(outcomes: list[Outcome]) -> float:
        await wait_until(lambda: any(o.tokens for o in outcomes), 120.0, "first tokens before the prefill kill")
        handles = r.chaos.handles("prefill")
        jobs = {worker_id: (await handle.stats.remote()).num_jobs for worker_id, handle in handles.items()}
        victim_id = max(jobs, key=lambda worker_id: jobs[worker_id])
        assert jobs[victim_id] > 0, f"no prefill worker held a prompt when the kill came: {jobs}"
        ray.kill(handles[victim_id], no_restart=True)
        return time.time()

    return inject


def test_kill_a_prefill_worker_mid_prefill(runner: Runner) -> None:
    figures = runner.run(_scenario(runner, _kill_the_busiest_prefill_worker(runner)))
    _check(runner, "kill_prefill_worker", figures, min_migrations=1)


@pytest.mark.parametrize(
    "rule",
    [
        FaultRule(action="drop", op="send", nth=4),
        FaultRule(action="delay", op="send", nth=4, delay_s=3 * TRANSFER_TIMEOUT_S),
        FaultRule(action="fail", op="send", nth=4),
    ],
    ids=["drop", "delay", "fail"],
)
def test_transfer_fault(runner: Runner, rule: FaultRule) -> None:
    prefill = runner.chaos.handles("prefill")
    armed_at = time.time()

    async def prepare() -> None:
        for handle in prefill.values():
            await handle.arm_fault.remote(None)
            await handle.arm_fault.remote(rule.encode())

    async def inject(outcomes: list[Outcome]) -> float:
        return await runner.chaos.fault_fired_at("prefill", since=armed_at)

    try:
        figures = runner.run(_scenario(runner, inject, prepare))
    finally:
        for handle in prefill.values():
            runner.run(handle.arm_fault.remote(None))
    _check(runner, f"transfer_{rule.action}", figures, min_migrations=1)
