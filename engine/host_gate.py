"""A draw's wait, on the device, for a grammar mask the host is still filling.

The grammar book fills a draw's bitmask on its own thread while the engine thread goes on (builds
the step's outputs, schedules and launches the next forward). The draw is queued at once behind
`HostGate.wait(ticket)`: one program that spins on a pinned host word until the host's
`open(ticket)` writes it, so the mask's copy, queued after the wait, reads the filled buffer, and
the engine thread never blocks on the fill: the fill overlaps the device's forward instead of
adding to the host's share of the step.

Invariants: the work that opens a ticket is handed to its thread before the launch that waits for
it, and opens it whatever happens (finally), so a queued wait always ends; tickets open in the order
they were taken (a ticket's fill starts after the previous gated draw's tokens were read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["HostGate"]


@triton.jit(do_not_specialize=["ticket"])  # NOTE: one variant for every ticket (int32; int64 past 2**31)
def _wait_kernel(word_ptr, ticket):
    """Returns once the host word (pinned, read through the bus each time) reaches ticket."""
    while tl.load(word_ptr, volatile=True) < ticket:
        pass


class HostGate:
    """One engine's gate: tickets taken by the engine thread, opened by whichever thread fills."""

    def __init__(self, pin_memory: bool = True) -> None:
        self._word = torch.zeros(1, dtype=torch.int64, pin_memory=pin_memory)  # NOTE: pinned: the device reads it
        self._host = self._word.numpy()  # NOTE: a plain store, no torch dispatch, from any thread
        self._taken = 0

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

    def wait(self, ticket: int) -> None:
        """Queues, on the current stream, a wait for ticket: what is queued after runs once it is open."""
        _wait_kernel[(1,)](self._word, ticket, num_warps=1)
