"""A draw's wait, on the device, for a grammar mask the host is still filling.

The grammar book fills a draw's bitmask on its own thread while the engine thread goes on (builds
the step's outputs, schedules and launches the next forward). The draw is queued at once behind
`HostGate.wait(ticket)`: one program that spins on a pinned host word until the host's
`open(ticket)` writes it, so the mask's copy, queued after the wait, reads the filled buffer, and
the engine thread never blocks on the fill: the fill overlaps the device's forward instead of
adding to the host's share of the step.

Invariants: the work that opens a ticket is handed to its thread before the launch that waits for
it, and opens it whatever happens (finally), so a queued wait always ends; tickets open in the order
they were taken (a ticket's fill starts after the previous gated draw's tokens were read). Should a
wait still outlast MAX_SPINS reads of the word (tens of seconds: a host that stopped), it ends
anyway and writes its ticket to the gate's second word, so the host raises (`late`) instead of the
device hanging with every request in it.
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
    """One engine's gate: tickets taken by the engine thread, opened by whichever thread fills."""

    def __init__(self, pin_memory: bool = True, max_spins: int = MAX_SPINS) -> None:
        # NOTE: pinned: the device reads word 0 (the last ticket opened) and writes word 1 (one it gave up on)
        self._words = torch.zeros(2, dtype=torch.int64, pin_memory=pin_memory)
        self._host = self._words.numpy()  # NOTE: plain loads and stores, no torch dispatch, from any thread
        self._taken = 0
        self.max_spins = max_spins

    def take(self) -> int:
        """A new ticket, closed until `open(it)`."""
        self._taken += 1
        return self._taken

    def open(self, ticket: int) -> None:
        """Lets the waits for ticket (and earlier ones) end; any thread."""
        self._host[0] = ticket

    def is_open(self, ticket: int) -> bool:
        """Whether ticket has opened (as the host sees the word)."""
        return int(self._host[0]) >= ticket

    def late(self) -> int:
        """A ticket whose wait gave up before it opened (its draw ran on an unfilled mask), or 0."""
        return int(self._host[1])

    def wait(self, ticket: int) -> None:
        """Queues, on the current stream, a wait for ticket: what is queued after runs once it is open."""
        _wait_kernel[(1,)](self._words, ticket, MAX_SPINS=self.max_spins, num_warps=1)
