"""A prefill worker's pushes: the prompt's KV gathered for one (Gathered), an early handshake's
outcome (Early), and the figures of pushes that end after their answers (PushLog:
PrefillWorkerConfig.answer_before_push), which the answers cannot carry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvtransfer.protocol import PrefillResultMsg

log = logging.getLogger(__name__)

NUM_PUSH_RECORDS = 1024  # the latest pushes that ended after their answer (PushLog.records)


@dataclass
class PushTotals:
    """Pushes that ended after their answers (answer_before_push), since start: their answers could
    not carry these, so the worker's stats do (router metrics read them per worker)."""

    num_pushed: int = 0
    num_failed: int = 0  # each also reported to its router by the decode worker
    push_bytes: int = 0
    push_seconds: float = 0.0  # summed, each from the first token to its sends done

    def add(self, result: PrefillResultMsg) -> None:
        self.num_pushed += 1
        self.push_bytes += result.push_bytes
        self.push_seconds += result.push_s

    def stats(self) -> dict[str, Any]:
        return {"num_kv_pushes_after_answer": self.num_pushed, "num_kv_push_failures_after_answer": self.num_failed,
                "kv_push_bytes_after_answer": self.push_bytes, "kv_push_seconds_after_answer": self.push_seconds}


@dataclass
class PushLog:
    """The pushes that ended after their answers: the latest ones whole (`records`, oldest first,
    each a PrefillResultMsg with push_s from the first token to its sends done) and totals since start."""

    records: deque[PrefillResultMsg] = field(default_factory=lambda: deque(maxlen=NUM_PUSH_RECORDS))
    totals: PushTotals = field(default_factory=PushTotals)

    def ended(self, rid: str, done: asyncio.Task[PrefillResultMsg], prefilled: float) -> None:
        """`done` (the push of `rid`, its first token sampled at perf_counter `prefilled`) has ended; a
        failure is counted and logged (the decode worker has told the router)."""
        ended = time.perf_counter()
        if done.cancelled() or done.exception() is not None:
            error = "cancelled" if done.cancelled() else f"{type(done.exception()).__name__}: {done.exception()}"
            result = PrefillResultMsg(request_id=rid, error=error)
        else:
            result = done.result()
        if result.error is not None:
            self.totals.num_failed += 1
            log.warning("push of %s after its answer: %s", rid, result.error)
            return
        if not result.push_bytes:
            return  # aborted meanwhile: nothing was pushed for decoding
        timed = result.model_copy(update={
            "push_s": ended - prefilled, "push_marks_s": [t - prefilled for t in result.push_marks_s],
        })
        self.records.append(timed)
        self.totals.add(timed)

    def stats(self) -> dict[str, Any]:
        return self.totals.stats()


class Gathered(NamedTuple):
    """A prompt's KV in one contiguous buffer, and CUDA events around the gather (None on the CPU)."""

    buffer: torch.Tensor
    started: torch.cuda.Event | None
    ended: torch.cuda.Event | None

    def device_seconds(self) -> float:
        """The gather's time on the device once it has run (0.0 where not timed)."""
        if self.started is None or self.ended is None:
            return 0.0
        self.ended.synchronize()  # NOTE: long done: the send that read the buffer has finished
        return self.started.elapsed_time(self.ended) / 1e3


class Early(NamedTuple):
    """An early handshake's outcome. decode_id set: accepted, and the pair's lock is held for the
    sends; None: refused or failed (`failure` says how), the lock released."""

    decode_id: str | None
    failure: str | None
    epoch: int
    lock: asyncio.Lock
    num_messages: int  # the KV's layer groups the decode side posted receives for
    draft: bool  # the decode side posted a receive for the draft's KV too (it comes last)


def has_result(future: asyncio.Future[Any] | None) -> bool:
    """Whether a future is done with a result (not cancelled, no exception)."""
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


__all__ = ["Early", "Gathered", "NUM_PUSH_RECORDS", "PushLog", "PushTotals", "has_result"]
