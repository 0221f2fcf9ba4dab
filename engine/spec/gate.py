"""Whether a step drafts: from the output rate the engine measures with and without drafting, at the
running batch's size.

Drafting pays when a verification's extra tokens outweigh its cost; where they do not depends on the
pair, the GPU, the batch and the text (the trained pair on an H200 at batch 32 and T = 1 ran 0.54x
plain decoding, while the 8B shape gained 1.63x at batch 32: docs/speculative-decoding.md). So the
engine measures it. Per bucket of batch sizes (1, 2-3, 4-7, ...) the gate keeps the last WINDOW
rates of each kind of decode-only step, a step's output tokens over the wall time of its `step`
call and over its running requests (tokens a second a request: a bucket's steps come at several
batch sizes, and a step's tokens grow with its batch where its time barely does, so whole-batch
rates would compare the sizes rather than the kinds), and holds to one kind: a bucket drafts for
its first FIRST_HOLD measured steps, then decodes plainly for PROBE steps, then keeps the kind
whose median rate is higher for HOLD steps, doubling up to MAX_HOLD each time a probe of the other
kind confirms it and back to HOLD when one overturns it.
So a pair that pays loses at most one probe in MAX_HOLD steps once settled, and one that does not
drafts for FIRST_HOLD steps and then rarely.

The first step after the kind changes is not measured: moving between asynchronous and synchronous
steps, that call reads or starts a step of the other kind. Steps that compute prompt tokens are not
measured either (their time is the prompt's). Past `disable_above_batch_size` no step drafts and the
gate is not asked (the drafting graphs end there). Engine thread only.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["DraftGate", "FIRST_HOLD", "HOLD", "MAX_HOLD", "PROBE", "WINDOW"]

WINDOW = 8  # rates kept a kind a bucket
FIRST_HOLD = 16  # measured drafting steps before a bucket's first probe
PROBE = 4  # measured steps of the kind not held, a probe
HOLD = 32  # measured steps of the faster kind before the next probe...
MAX_HOLD = 1024  # ...doubling to this while probes confirm it


@dataclass
class _Bucket:
    held: bool = True  # the kind held to (True: drafting)
    probing: bool = False
    left: int = FIRST_HOLD  # measured steps left in this phase
    hold: int = HOLD
    rates: dict[bool, deque[float]] = field(
        default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
    )

    @property
    def drafts(self) -> bool:
        return self.held != self.probing


class DraftGate:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._last: bool | None = None  # the kind of the last step observed
        self.num_overturns = 0  # probes that changed a bucket's kind, since start

    def drafts(self, batch_size: int) -> bool:
        """Whether a step of batch_size running requests drafts."""
        return self._bucket(batch_size).drafts

    def observe(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A decode-only step of batch_size requests that drafted or not took `seconds` and gave
        `tokens` output tokens."""
        switched = self._last is not None and drafted != self._last
        self._last = drafted
        bucket = self._bucket(batch_size)
        if switched or drafted != bucket.drafts or seconds <= 0.0 or tokens <= 0:
            return  # NOTE: a step of the kind the bucket did not choose (one the gate was not asked for)
        bucket.rates[drafted].append(tokens / seconds / max(1, batch_size))
        bucket.left -= 1
        if bucket.left > 0:
            return
        if not bucket.probing:
            bucket.probing, bucket.left = True, PROBE
            return
        faster = statistics.median(bucket.rates[True]) >= statistics.median(bucket.rates[False])
        if faster == bucket.held:
            bucket.hold = min(2 * bucket.hold, MAX_HOLD)
        else:
            bucket.held, bucket.hold = faster, HOLD
            self.num_overturns += 1
        bucket.probing, bucket.left = False, bucket.hold

    def unmeasured(self, drafted: bool) -> None:
        """A step the gate does not measure (past disable_above_batch_size) that drafted or not: the
        next step of the other kind is the first after a switch."""
        self._last = drafted

    def rates(self, batch_size: int) -> tuple[float | None, float | None]:
        """The bucket's median rates (tokens a second a running request) drafting and not; None: not
        measured."""
        rates = self._bucket(batch_size).rates
        return _median(rates[True]), _median(rates[False])

    def _bucket(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(max(1, batch_size).bit_length(), _Bucket())


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None
