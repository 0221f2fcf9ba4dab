"""The gate a constrained draw waits on (engine/host_gate.py): under Triton's interpreter its wait ends
when another thread opens the ticket, not before; an open ticket (or an earlier one) passes at once, int32
and int64 alike; a wait nobody opens gives up after its reads and says so (the grammar book raises); and
compiled for Hopper on the CPU, its loop reads the host word through the bus (a volatile load) and lets no
later kernel in early. NOTE: the module is imported under TRITON_INTERPRET
(tests/interpreted.py says how, and why this skips otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.interpreted import import_interpreted, interpreted_triton  # noqa: F401 (the fixture, used below)

host_gate = import_interpreted("engine.host_gate", "_wait_kernel")
pytestmark = pytest.mark.usefixtures("interpreted_triton")

ROOT = Path(__file__).resolve().parents[3]


def _gate(**kwargs) -> tuple[object, object]:
    """A gate and its words; word 0 written here as the grammar process writes it (the ticket opened)."""
    import torch

    words = torch.zeros(2, dtype=torch.int64)
    return host_gate.HostGate(words, **kwargs), words


def test_a_wait_ends_when_another_thread_opens_its_ticket() -> None:
    gate, words = _gate()
    ticket = 1
    assert int(words[0]) < ticket
    opened_at: list[float] = []

    def open_later() -> None:
        time.sleep(0.3)
        opened_at.append(time.perf_counter())
        words[0] = ticket

    opener = threading.Thread(target=open_later)
    opener.start()
    gate.wait(ticket)
    returned = time.perf_counter()
    opener.join(timeout=10)
    assert opened_at and returned >= opened_at[0]  # it waited for the open, not less
    assert int(words[0]) >= ticket


def test_open_and_earlier_tickets_pass_at_once() -> None:
    gate, words = _gate()
    first, second = 1, 2
    words[0] = second
    started = time.perf_counter()
    for ticket in (first, second, 0, -(1 << 40)):  # an int64 ticket too (the warm-up's)
        gate.wait(ticket)
    assert time.perf_counter() - started < 5  # nothing spins: every word already reached


def test_a_wait_nobody_opens_gives_up_and_the_book_raises() -> None:
    from engine.grammar_book import GrammarBook
    from engine.models import DEFAULT_MODEL_DIR

    book = GrammarBook(DEFAULT_MODEL_DIR, 2048, [1], capacity=1)
    gate, words = _gate(max_spins=50)
    book._gate = gate
    first, second = 1, 2
    words[0] = first
    gate.wait(first)
    assert gate.late() == 0
    book.settle()  # nothing late: no error
    gate.wait(second)  # never opened: ends after 50 reads
    assert gate.late() == second
    with pytest.raises(RuntimeError, match="gave up waiting for a constrained draw's mask"):
        book.settle()


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.host_gate import _wait_kernel
kernel = triton.compile(ASTSource(fn=_wait_kernel, signature={"word_ptr": "*i64", "ticket": "i64",
                                                           "MAX_SPINS": "constexpr"},
                                  constexprs={"MAX_SPINS": 1 << 25}), target=GPUTarget("cuda", 90, 32))
print(kernel.asm["ptx"])
"""


def test_the_wait_compiles_for_hopper_reading_the_host_word_each_turn() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    loop = ptx[ptx.index("Loop Header") :]
    assert "ld.volatile.global.b64" in loop.split("bra")[0]  # the load is inside the loop, never cached
    assert "st.global.b64" in ptx  # the ticket given up on, written back
    assert "griddepcontrol" not in ptx  # what is queued after starts only once the wait has ended
