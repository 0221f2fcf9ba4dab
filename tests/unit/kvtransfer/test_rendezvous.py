"""kvtransfer/rendezvous.py's PollingStore: a pair group's view of a worker's shared TCPStore whose
waits poll and end at the pairing's deadline (then at each call's own timeout), and never hold the
shared store object while they wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from kvtransfer.rendezvous import PollingStore


@pytest.fixture
def shared() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_get_returns_a_value_set_later_while_the_shared_store_stays_free(shared: dist.TCPStore) -> None:
    view = PollingStore(shared, time.monotonic() + 5.0, 30.0, "test")
    threading.Timer(0.3, lambda: shared.set("k", "v")).start()
    started = time.monotonic()
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(view.get("k")), daemon=True)
    waiter.start()
    time.sleep(0.05)
    other = time.monotonic()
    assert not shared.check(["other"])  # answered at once while the view waits for "k"
    assert time.monotonic() - other < 0.1
    waiter.join(5.0)
    assert got == [b"v"] and 0.25 < time.monotonic() - started < 2.0


def test_a_wait_fails_at_the_pairing_s_deadline_and_names_what_it_waited_for(shared: dist.TCPStore) -> None:
    view = PollingStore(shared, time.monotonic() + 0.3, 30.0, "pairing 'd' with 'p'")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"pairing 'd' with 'p': the peer did not build .*\['never'\]"):
        view.wait(["never"], timedelta(seconds=30))  # the deadline comes before the call's own timeout
    assert 0.25 < time.monotonic() - started < 1.5


def test_once_formed_a_wait_ends_at_its_own_timeout(shared: dist.TCPStore) -> None:
    view = PollingStore(shared, None, 0.2, "test")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        view.get("never")  # no timeout given: the view's call_timeout_s
    assert 0.15 < time.monotonic() - started < 1.5
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        view.wait(["never"], timedelta(milliseconds=100))
    assert 0.05 < time.monotonic() - started < 1.0
    view.set("here", "1")
    view.wait(["here"])
    assert view.add("n", 2) == 2 and view.check(["here"]) and not view.has_extended_api()
