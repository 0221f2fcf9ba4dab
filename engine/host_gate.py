"""A draw's wait, on the device, for a grammar mask the host is still filling.

The grammar process fills a draw's bitmask while the engine thread goes on (builds the step's
outputs, schedules and launches the next forward). The draw is queued at once behind
`HostGate.wait(ticket)`: one program that spins on a host word (pinned or registered, shared with
that process) until the process writes the ticket there, so the mask's copy, queued after the
wait, reads the filled buffer, and the engine thread never blocks on the fill: the fill overlaps
the device's forward instead of adding to the host's share of the step.

Invariants: the work that opens a ticket is sent before the launch that waits for it, and opens it
whatever happens (finally), so a queued wait always ends; tickets open in the order they were taken
(the process does its work in order). Should a wait still outlast MAX_SPINS reads of the word (tens
of seconds: a process that stopped), it ends anyway and writes its ticket to the gate's second
word, so the host raises (`late`) instead of the device hanging with every request in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["HostGate"]

MAX_SPINS = 1 << 25
"""Reads of the host word a wait makes before it gives up (each crosses the bus: 1-2 us on PCIe)."""


@triton.jit(do_not_specialize=["ticket"])  # NOTE: one variant for every ticket (int32; int64 past 2**31)
def _wait_kernel(word_ptr, ticket, MAX_SPINS: tl.constexpr):
    """Returns once the host word (pinned, read through the bus each time) reaches ticket, or after
    MAX_SPINS reads, writing ticket to the second word then."""
    spins = 0
    while (tl.load(word_ptr, volatile=True) < ticket) & (spins < MAX_SPINS):
        spins += 1
    if spins >= MAX_SPINS:
        tl.store(word_ptr + 1, ticket)


class HostGate:
    """One engine's gate over two int64 host words the device can read: word 0 the last ticket
    opened (by whichever thread or process fills), word 1 a ticket the device gave up on."""

    def __init__(self, words: torch.Tensor, max_spins: int = MAX_SPINS) -> None:
        """words: the two words, written by the filler (word 0: engine/grammar_process.py)."""
        self._words = words
        self._host = words.numpy()  # NOTE: a plain load, no torch dispatch
        self.max_spins = max_spins

    def late(self) -> int:
        """A ticket whose wait gave up before it opened (its draw ran on an unfilled mask), or 0."""
        return int(self._host[1])

    def wait(self, ticket: int) -> None:
        """Queues, on the current stream, a wait for ticket: what is queued after runs once it is open."""
        _wait_kernel[(1,)](self._words, ticket, MAX_SPINS=self.max_spins, num_warps=1)
