"""GcPauses: the collector's pauses in this process while started, read from gc.callbacks; RecentMax keeps
the longest of the last seconds alike for every reader."""

from __future__ import annotations

import gc

from engine.process_gc import GcPauses
from engine.recent import RecentMax


def test_pauses_are_counted_while_started_and_the_longest_is_the_window_s() -> None:
    now = [10.0]
    pauses = GcPauses(clock=lambda: now[0]).start()
    try:
        for took in (0.25, 0.5):
            pauses._observe("start", {})  # NOTE: the callback as the collector calls it, on a clock we move
            now[0] += took
            pauses._observe("stop", {})
            now[0] += 1.0
        gc.collect()  # a real pass: counted too, on the frozen clock as no time
    finally:
        pauses.stop()
    assert pauses.seconds == 0.75
    assert pauses.longest_recent == 0.5 and pauses.longest_recent == 0.5  # reading it takes nothing away
    now[0] += 10.0
    assert pauses.longest_recent == 0.0  # out of the window
    gc.collect()  # stopped: not counted
    assert pauses.seconds == 0.75 and pauses._observe not in gc.callbacks


def test_a_real_pass_over_many_objects_takes_measurable_time() -> None:
    objects = [[i] for i in range(100_000)]
    pauses = GcPauses().start()
    try:
        gc.collect()
    finally:
        pauses.stop()
    assert 0 < pauses.longest_recent <= pauses.seconds
    del objects


def test_recent_max_forgets_what_left_the_window() -> None:
    now = [0.0]
    recent = RecentMax(window_s=10.0, clock=lambda: now[0])
    assert recent.value() == 0.0
    recent.observe(3.0)
    now[0] = 5.0
    recent.observe(1.0)
    assert recent.value() == 3.0
    now[0] = 12.0  # the 3.0 is 12 s old, the 1.0 7 s
    assert recent.value() == 1.0


def test_recent_max_reads_while_another_thread_observes() -> None:
    import threading

    recent = RecentMax(window_s=1e9)
    stop = threading.Event()

    def observe() -> None:
        for i in range(200_000):  # bounded
            if stop.is_set():
                return
            recent.observe(float(i % 7))

    writer = threading.Thread(target=observe)
    writer.start()
    try:
        values = [recent.value() for _ in range(2_000)]  # never raises "deque mutated during iteration"
    finally:
        stop.set()
        writer.join(30)
    assert max(values) <= 6.0
