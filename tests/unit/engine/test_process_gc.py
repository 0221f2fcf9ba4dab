"""GcPauses: the collector's pauses in this process while started, read from gc.callbacks."""

from __future__ import annotations

import gc

from engine.process_gc import GcPauses


def test_pauses_are_counted_while_started_and_the_longest_is_taken_once() -> None:
    ticks = iter([10.0, 10.25, 20.0, 20.5])  # two passes: 0.25 s, then 0.5 s
    pauses = GcPauses(clock=lambda: next(ticks)).start()
    try:
        gc.collect()
        gc.collect()
    finally:
        pauses.stop()
    assert pauses.seconds == 0.75
    assert pauses.take_longest() == 0.5 and pauses.take_longest() == 0.0
    gc.collect()  # stopped: not counted (the clock has no more ticks to give)
    assert pauses.seconds == 0.75 and pauses._observe not in gc.callbacks


def test_a_real_pass_over_many_objects_takes_measurable_time() -> None:
    objects = [[i] for i in range(100_000)]
    pauses = GcPauses().start()
    try:
        gc.collect()
    finally:
        pauses.stop()
    assert 0 < pauses.longest <= pauses.seconds
    del objects
