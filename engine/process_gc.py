"""The garbage collector of a serving process (a router replica, a worker actor), set once its startup is done.

The startup's objects (the model, the tokenizer, Ray, Serve, pydantic's schemas) live as long as the process: they
are moved out of the collector's reach (gc.freeze), whose full passes over them held the GIL for tens of ms
mid-stream. The youngest generation is collected after GEN0_THRESHOLD new container objects instead of Python's
700: serving makes several a request and a token, so each pass walked the young objects of every stream in flight,
hundreds of times a second. Cycles are still collected.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def settle_after_startup() -> None:
    """For a process that is one server's alone: cyclic garbage frozen with the startup would never be freed."""
    gc.collect()  # NOTE: first: garbage frozen would never be freed
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)
