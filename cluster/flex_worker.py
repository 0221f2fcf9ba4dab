"""FlexWorker: the actor every pool runs. It hosts a PrefillWorker or a DecodeWorker over one engine
and forwards every call to it, so the worker can change role in place: `flip` shuts the current role
down (channel, transport, engine thread: what it held was drained first by its pool), keeps the
engine (weights, KV cache, prefix cache, tensor-parallel ranks), and builds the other role over it
under the same worker id (cluster/pools.py: WorkerPool.hand_over drains it, then moves it).
"""

from __future__ import annotations

import inspect
from typing import Any

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineCore
from engine.parallel import RankStarter
from engine.parallel.local import LocalRanks
from prefill_worker import PrefillWorker, PrefillWorkerConfig

__all__ = ["FlexWorker"]

Role = PrefillWorker | DecodeWorker


class FlexWorker:
    def __init__(self, config: PrefillWorkerConfig | DecodeWorkerConfig,
                 transport_options: dict[str, Any] | None = None, start_ranks: RankStarter = LocalRanks) -> None:
        """config: the first role's (a PrefillWorkerConfig makes a prefill worker)."""
        self._options = transport_options
        self.role: Role = (PrefillWorker(config, transport_options, start_ranks)
                           if isinstance(config, PrefillWorkerConfig)
                           else DecodeWorker(config, transport_options, start_ranks))

    async def role_name(self) -> str:
        return "prefill" if isinstance(self.role, PrefillWorker) else "decode"

    async def flip(self, config: PrefillWorkerConfig | DecodeWorkerConfig) -> None:
        """Become the role `config` configures (drained first: nothing is held, nothing runs)."""
        engine: EngineCore = self.role.loop.engine
        if engine.has_unfinished() or engine.pool.num_held_blocks:
            raise RuntimeError(f"{self.role.worker_id}: drain before changing role ({engine.pool.num_held_blocks} "
                               "blocks held)")
        await self.role.shutdown(keep_engine=True)
        if isinstance(config, PrefillWorkerConfig):
            self.role = PrefillWorker(config, self._options, engine=engine)
        else:
            self.role = DecodeWorker(config, self._options, engine=engine)


def _forward(name: str) -> Any:
    async def call(self: FlexWorker, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.role, name, None)
        if method is None:
            raise AttributeError(f"a {await self.role_name()} worker has no {name!r}")
        result = method(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    call.__name__ = call.__qualname__ = name
    return call


# NOTE: Ray finds an actor's methods on its class: every public method of either role is defined here.
for _cls in (PrefillWorker, DecodeWorker):
    for _name, _ in inspect.getmembers(_cls, inspect.isfunction):
        if not _name.startswith("_") and not hasattr(FlexWorker, _name):
            setattr(FlexWorker, _name, _forward(_name))
