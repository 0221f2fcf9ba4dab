"""A prefill worker's pushes: the prompt's KV gathered for one (Gathered), and the figures of the
pushes that ended (PushLog: the latest whole, totals since start), which the answers, sent before
their pushes, cannot carry."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protocol.messages import PushRecordMsg, PushTotalsMsg

NUM_PUSH_RECORDS = 1024  # the latest pushes kept whole (PushLog.records)


@dataclass
class PushLog:
    records: deque[PushRecordMsg] = field(default_factory=lambda: deque(maxlen=NUM_PUSH_RECORDS))
    totals: PushTotalsMsg = field(default_factory=PushTotalsMsg)

    def pushed(self, record: PushRecordMsg) -> None:
        self.records.append(record)
        t = self.totals
        self.totals = t.model_copy(update={
            "num_pushed": t.num_pushed + 1, "push_bytes": t.push_bytes + record.push_bytes,
            "push_seconds": t.push_seconds + record.push_s,
            "send_device_seconds": t.send_device_seconds + record.send_device_s,
        })

    def ended(self, failed: bool) -> None:
        """A push that did not finish: it failed, or its request was aborted (a client that left)."""
        field = "num_failed" if failed else "num_cancelled"
        self.totals = self.totals.model_copy(update={field: getattr(self.totals, field) + 1})


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


__all__ = ["Gathered", "NUM_PUSH_RECORDS", "PushLog"]
