"""TransferEndpoint: what every worker kind shares — an engine on its own thread (EngineLoop) and a
KV transport — plus the control methods that only read them: integrity, health, fault injection.

Prefill and decode workers inherit it (neither may import the other). It knows nothing of
leases, prompts or routers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from engine import EngineConfig, EngineCore
from engine.loop import EngineLoop
from kvtransfer.fault import FaultRule, FaultTransport
from kvtransfer.transport import TransferError, TransferHandle, Transport

T = TypeVar("T")


class EndpointConfig(BaseModel):
    """What every worker kind is configured with; each kind's config adds its own fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str = Field("", description="Unique within the cluster; names the worker in messages (a pool's "
                           "template in ClusterConfig leaves it out).")
    engine: EngineConfig = EngineConfig()
    transport: str = Field("gloo", description="KV transport: 'nccl' on GPUs, 'gloo' on CPUs, 'local' in-process.")
    host: str = Field(
        "127.0.0.1", description="Address peers reach this worker's KV transport at; 'auto': this Ray node's IP."
    )
    transfer_timeout_s: float = Field(30.0, gt=0, description="Longest wait for one KV transfer to finish.")
    pair_timeout_s: float = Field(60.0, gt=0, description="Longest wait for a peer to pair.")
    freeze_gc: bool = Field(
        False,
        description="Once the engine is built, move every object of the process out of the garbage collector's "
        "reach (gc.freeze), whose full passes hold the GIL and stall the engine's step, and collect the youngest "
        "generation less often (engine/process_gc.py). For a process "
        "that is the worker's alone (a Ray actor); where one process builds many workers (tests), cyclic garbage "
        "frozen with it would never be freed.",
    )

    @property
    def longest_push_s(self) -> float:
        """How long a started push can last: its handshake (pair_timeout_s), the draft's buffer and each of its
        two sends (transfer_timeout_s each) are its bounded waits."""
        return self.pair_timeout_s + 3 * self.transfer_timeout_s


class TransferEndpoint:
    worker_id: str
    loop: EngineLoop
    transport: Transport
    _error: BaseException | None

    async def _call(self, command: Callable[[EngineCore], T]) -> T:
        """Runs `command(engine)` on the engine thread, between steps."""
        return await asyncio.wrap_future(self.loop.submit(command))

    async def check_integrity(self) -> int:
        """Raises if the block table is inconsistent; returns the number of held blocks."""

        def check(engine: EngineCore) -> int:
            engine.check_integrity()
            return engine.pool.num_held_blocks

        return await self._call(check)

    async def cache_delta(self, epoch: str, cursor: int) -> dict[str, Any]:
        """What the prefix cache stored and removed since a reader's (epoch, cursor) (engine/cache_events.py),
        with its block size: routers mirror it to send each prompt where its prefix is cached
        (protocol.api.CacheDeltaMsg's fields)."""

        def read(engine: EngineCore) -> dict[str, Any]:
            return {**engine.pool.journal.since(epoch, cursor)._asdict(), "block_size": engine.pool.block_size}

        return await self._call(read)

    async def health(self) -> bool:
        return self._error is None and self.loop.is_alive and self.loop.engine.ranks_alive

    # ---- fault injection (chaos tests)
    async def arm_fault(self, rule: bytes | None) -> None:
        """Arms a FaultRule (msgpack) on this worker's transport, or (None) disarms every rule."""
        fault = self._fault_transport()
        if rule is None:
            fault.disarm()
        else:
            fault.arm(FaultRule.decode(rule))

    async def fault_stats(self) -> dict[str, Any]:
        """Transfers seen and faults fired (with their time.time()) by this worker's fault transport."""
        stats = self._fault_transport().stats()
        return {"num_transfers": stats.num_transfers, "num_fired": stats.num_fired, "fired_at": stats.fired_at}

    def _fault_transport(self) -> FaultTransport:
        if not isinstance(self.transport, FaultTransport):
            raise ValueError(
                f"worker {self.worker_id!r} runs the {self.transport.name!r} transport; faults need transport='fault'"
            )
        return self.transport


async def wait_transfer(handle: TransferHandle, timeout_s: float) -> str | None:
    """None when the transfer finished well, else what went wrong.

    NOTE: polls `done()` (it never blocks) instead of a thread blocked in `wait()`: the event loop's
    default executor has only a few threads, and transfers that stall until their deadline (a dead
    peer) would hold them all, starving the pairing calls that also run there."""
    start = time.monotonic()
    deadline = start + timeout_s
    interval_s = 0.0001
    while not handle.done():
        now = time.monotonic()
        if now >= deadline:
            return f"timed out after {timeout_s} s"
        await asyncio.sleep(interval_s)
        # NOTE: every 0.1 ms while a transfer could still be a healthy one (a 2k-token prompt's KV
        # takes ~1 ms over NVLink, and each check costs ~1 us), then backing off to 5 ms.
        if now - start > 0.02:
            interval_s = min(2 * interval_s, 0.005)
    try:
        handle.wait(0.0)
    except TransferError as err:
        return f"failed: {err}"
    return None
