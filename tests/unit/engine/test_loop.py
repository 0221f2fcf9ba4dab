"""EngineLoop's account of its thread: the steps it took, the wall seconds inside them and inside the commands
run between them, returned with the engine's stats (what a worker reports and the router exports)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.loop import EngineLoop


def test_the_loop_counts_its_steps_and_times_its_steps_and_commands(make_llm: Callable[..., LLM],
                                                                    one_torch_thread: None) -> None:
    llm = make_llm(num_blocks=32, async_scheduling=True)  # NOTE: as on a GPU: a step waits for the one before
    finished: list[Any] = []
    loop = EngineLoop(llm.engine, lambda outs: finished.extend(o for o in outs if o.finish_reason)).start()
    try:
        before = loop.submit(lambda engine: loop.stats()).result(timeout=30)
        assert (before.num_engine_steps, before.engine_step_seconds) == (0, 0.0)
        loop.submit(lambda engine: time.sleep(0.2)).result(timeout=30)  # a command holds the thread for 0.2 s
        garbage = [[i] for i in range(50_000)]
        gc.collect()  # a full pass of this process's collector, over young garbage
        del garbage
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        loop.submit(lambda engine: engine.add_request("a", [1, 2, 3, 4], params)).result(timeout=30)
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished, "the request did not finish within 60 s"
        after = loop.submit(lambda engine: loop.stats()).result(timeout=30)
    finally:
        loop.stop()
    # a prompt step and four decode steps at least (asynchronous scheduling may add an empty one)
    assert after.num_engine_steps >= 5 and after.num_engine_steps == loop.num_steps
    assert after.engine_step_seconds > 0
    assert 0 < after.longest_recent_step_seconds <= after.engine_step_seconds
    assert 0.2 <= after.engine_command_seconds < 0.2 + after.engine_step_seconds + 5.0
    assert after.load()["num_engine_steps"] == after.num_engine_steps  # what a worker puts in its stats
    assert after.num_alloc_retries == 0 and after.num_device_frees == 0  # no CUDA allocator on the CPU
    # every step's time as its timer saw it (on the CPU its launch, which runs it) and the waits for tokens
    assert 0 < after.step_device_seconds <= after.engine_step_seconds
    assert 0 < after.step_wait_seconds <= after.engine_step_seconds
    assert after.follower_forward_seconds == 0.0 and after.follower_call_seconds == 0.0  # one rank
    # the collector's pauses while the loop ran: the full pass at least
    assert 0 < after.longest_recent_gc_seconds <= after.gc_seconds
    assert after.follower_gc_seconds == 0.0


class _PutAfterTheLoopEnds:
    """The loop's command queue, whose put first starts the loop and gives its thread half a second to end (its
    engine's step raises at once): the race of a submit with a loop that dies between the submit's check and
    its put."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop, self._queue = loop, loop._commands

    def put(self, item: Any) -> None:
        self._loop.start()
        self._loop._thread.join(0.5)
        self._queue.put(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def test_a_command_submitted_as_the_loop_dies_fails_instead_of_waiting_forever() -> None:
    def step() -> None:
        raise RuntimeError("a rank died")

    engine: Any = SimpleNamespace(has_unfinished=lambda: True, step=step)
    loop = EngineLoop(engine, lambda outs: None)
    loop._commands = _PutAfterTheLoopEnds(loop)  # type: ignore[assignment]
    future = loop.submit(lambda engine: 1)
    with pytest.raises(RuntimeError, match="stopped before running this command"):
        future.result(timeout=5)
    loop._thread.join(5)
    assert not loop._thread.is_alive()
