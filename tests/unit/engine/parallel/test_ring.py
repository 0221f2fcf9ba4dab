"""The step ring's waiting (engine/parallel/ring.py): a reader spins through its spin window and sleeps only
after it, a GPU rank's window is the long one, and a message written in another process arrives whole."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from engine.parallel import ring


def _sleeps_while_waiting(monkeypatch: pytest.MonkeyPatch, ready_after_s: float, spin_s: float) -> list[float]:
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(ring.time, "sleep", sleep)
    start = time.perf_counter()
    ring._wait(lambda: time.perf_counter() - start > ready_after_s, lambda: True, "the test's writer", spin_s)
    return slept


def test_a_reader_spins_through_its_window_and_sleeps_only_past_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _sleeps_while_waiting(monkeypatch, 0.01, spin_s=1.0) == []
    slept = _sleeps_while_waiting(monkeypatch, 0.03, spin_s=0.002)
    assert slept and slept[0] == 1e-5 and all(b == min(2 * a, ring.MAX_SLEEP_S) for a, b in zip(slept, slept[1:]))


def test_a_gpu_rank_spins_past_a_decode_step_and_a_cpu_rank_briefly() -> None:
    assert ring.reader_spin_s("cuda") == ring.GPU_SPIN_S >= 0.05
    assert ring.reader_spin_s("cpu") == ring.SPIN_S <= 0.002


def _write(names: multiprocessing.Queue, done: multiprocessing.Queue, payloads: list[bytes]) -> None:
    writer = ring.RingWriter(1)
    names.put((writer.name, os.getpid()))
    for payload in payloads:
        writer.write(payload)
    done.get(timeout=60)  # the reader has read them all
    writer.close()


def test_messages_from_another_process_arrive_whole_and_in_order() -> None:
    payloads = [b"step", os.urandom(ring.SLOT_BYTES * 2 + 5), b""]  # one slot, three slots, empty
    ctx = multiprocessing.get_context("spawn")
    names, done = ctx.Queue(), ctx.Queue()
    writer = ctx.Process(target=_write, args=(names, done, payloads))
    writer.start()
    try:
        name, pid = names.get(timeout=60)
        reader = ring.RingReader(name, 1, 0, pid, spin_s=ring.SPIN_S)
        assert [reader.read() for _ in payloads] == payloads
        reader.close()
        done.put("done")
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0
