"""PrefillWorkerConfig: a prefill worker's settings beside its endpoint's (transport, timeouts)."""

from __future__ import annotations

from kvtransfer.endpoint import EndpointConfig


class PrefillWorkerConfig(EndpointConfig):
    """A prefill worker has no settings of its own yet: what it computes comes from `engine`, how it
    pushes from the endpoint's fields. When the engine drafts with a model, the worker also computes
    each prompt's draft KV and offers it to the decode worker (prefill_worker/draft.py)."""


__all__ = ["PrefillWorkerConfig"]
