"""run_requests: sends a workload on its arrival schedule, at most MAX_CONCURRENCY at a time, within
an overall duration cap, and collects one RequestRecord for every request that left the client.
Also the progress bar it draws on stderr.

Counts: every request planned is either sent (and has exactly one record, success or error) or not
sent (the duration cap came first). A request still running at the cap is cancelled and recorded as
an error, so sent = completed + errored always holds.

Knows nothing of HTTP: `send` (the client) turns one request into one record.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from loadgen.records import RequestRecord
from loadgen.workloads import BenchRequest

SendFn = Callable[[int, BenchRequest, float], Awaitable[RequestRecord]]
"""send(index, request, origin) -> its record, times in s from `origin` on the runner's clock."""


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]  # one per request sent, in workload order
    duration_s: float  # from the run's start to its last request's end (or the cap)
    num_planned: int
    num_not_sent: int  # planned but never sent: the duration cap came first
    is_capped: bool  # the duration cap ended the run


class Progress:
    """A one-line progress bar on a text stream (stderr): redrawn in place on a terminal, a line
    every tenth of the run elsewhere (logs, CI)."""

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None, is_enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, width: int = 30) -> None:
        self.total, self.label, self.is_enabled, self.clock, self.width = total, label, is_enabled, clock, width
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.num_done = self.num_errors = 0
        self.started = clock()
        self._last_draw = -1.0
        self._last_tenth = -1

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_errors += not record.is_success
        if not self.is_enabled:
            return
        now = self.clock()
        tenth = self.num_done * 10 // max(self.total, 1)
        if self.is_tty and (now - self._last_draw >= 0.1 or self.num_done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line())
        elif not self.is_tty and tenth != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def line(self) -> str:
        filled = self.width * self.num_done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        head = f"{self.label} " if self.label else ""
        return (f"{head}[{bar}] {self.num_done}/{self.total} done, {self.num_errors} errors, "
                f"{self.clock() - self.started:.1f} s")

    def close(self) -> None:
        if self.is_enabled and self.is_tty:
            self.stream.write("\n")
            self.stream.flush()


async def run_requests(
    requests: Sequence[BenchRequest], offsets: Sequence[float], send: SendFn, *,
    max_concurrency: int | None = None, duration: float | None = None,
    clock: Callable[[], float] = time.perf_counter, progress: Progress | None = None,
) -> RunResult:
    """Sends request i at offsets[i] s after the start (later if MAX_CONCURRENCY are in flight);
    sends nothing at or after DURATION s and cancels what still runs then."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(requests)} requests: they must match")
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sent_at: dict[int, float] = {}  # request index -> s from origin, once past the concurrency limit
    origin = clock()

    async def one(index: int, request: BenchRequest) -> RequestRecord:
        async with limiter if limiter is not None else contextlib.nullcontext():
            sent_at[index] = clock() - origin
            try:
                record = await send(index, request, origin)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a client bug must still leave a record
                record = RequestRecord(index, request.max_tokens, sent_at[index], clock() - origin,
                                       error=f"client error: {type(err).__name__}: {err}")
        if progress is not None:
            progress.update(record)
        return record

    tasks: dict[int, asyncio.Task[RequestRecord]] = {}
    for index, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
        if duration is not None and offset >= duration:
            break
        delay = origin + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks[index] = asyncio.create_task(one(index, request))
    pending: set[asyncio.Task[RequestRecord]] = set(tasks.values())
    if pending:
        timeout = None if duration is None else max(0.0, origin + duration - clock())
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    end = clock() - origin
    if progress is not None:
        progress.close()

    records = []
    for index, task in tasks.items():
        if not task.cancelled():
            records.append(task.result())
        elif index in sent_at:
            records.append(RequestRecord(index, requests[index].max_tokens, sent_at[index], max(end, sent_at[index]),
                                         error=f"cancelled: still running at the duration cap of {duration} s"))
    return RunResult(records=records, duration_s=end, num_planned=len(requests),
                     num_not_sent=len(requests) - len(records), is_capped=bool(pending) or len(tasks) < len(requests))
