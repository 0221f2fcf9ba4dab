"""asyncio.run with a watchdog: a test whose loop waits forever ends in TimeoutError after timeout_s, having
written where every task and thread waited to stderr (pytest shows it with the failure). pytest-timeout's own dump
shows only threads, and a hung event loop's thread is idle in its selector, which says nothing of which await
never ended."""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_watched(main: Coroutine[Any, Any, T], timeout_s: float = 240.0) -> T:
    """Runs `main` as asyncio.run does; past timeout_s (also while the loop winds down: its tasks cancelled, its
    executor joined) dumps every thread's and task's stack, cancels every task and raises TimeoutError."""
    runner = asyncio.Runner()
    loop = runner.get_loop()
    expired = threading.Event()

    def dump_and_cancel() -> None:
        tasks = asyncio.all_tasks(loop)
        print(f"run_watched: {len(tasks)} tasks still waiting after {timeout_s} s:", file=sys.stderr)
        for task in tasks:
            task.print_stack(file=sys.stderr)
            task.cancel()

    def expire() -> None:
        expired.set()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            print(f"run_watched: thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}",
                  file=sys.stderr)
        loop.call_soon_threadsafe(dump_and_cancel)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        with runner:
            result = runner.run(main)
    except asyncio.CancelledError:
        if expired.is_set():
            raise TimeoutError(f"the test's event loop ran past {timeout_s} s (stacks above)") from None
        raise
    finally:
        timer.cancel()
    if expired.is_set():
        raise TimeoutError(f"the test's event loop ran past {timeout_s} s (stacks above)")
    return result
