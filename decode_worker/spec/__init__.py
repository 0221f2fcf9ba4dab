"""The decode worker's speculative decoding: what it configures, not how it runs.

The proposers (n-gram lookup, draft model) and the verification live in the engine (engine/spec/,
`Sampler.verify`): the engine builds its proposer from `EngineConfig.speculative`, and engine/
imports nothing of ours, so a decode worker speculates when its `DecodeWorkerConfig.engine` says
so, with no code of its own. In the disaggregated path the draft model prefills its own KV on the
decode worker when a request arrives (its first drafting step catches up on the prompt, within
the step's token budget); the prefill worker ships only the target's KV.

This package holds the decode worker's choice of speculation and re-exports the engine's names.
"""

from __future__ import annotations

from engine.config import EngineConfig, SpeculativeConfig
from engine.spec import DraftModelProposer, NgramProposer, Proposer, available_proposers

DEFAULT_DISABLE_ABOVE_BATCH_SIZE = 32
"""Drafting stops above this many running requests: a large batch is compute bound, and verifying
K extra tokens a request then costs about as much as it saves (to be tuned on a GPU)."""


def decode_speculation(method: str = "ngram", draft_model: str | None = None, **options: object) -> SpeculativeConfig:
    """A SpeculativeConfig for decode workers: adaptive K, and off above
    DEFAULT_DISABLE_ABOVE_BATCH_SIZE running requests unless `options` say otherwise."""
    options.setdefault("disable_above_batch_size", DEFAULT_DISABLE_ABOVE_BATCH_SIZE)
    return SpeculativeConfig(method=method, draft_model=draft_model, **options)  # type: ignore[arg-type]


def with_speculation(engine: EngineConfig, speculative: SpeculativeConfig) -> EngineConfig:
    """`engine` with speculative decoding set; pass the result as DecodeWorkerConfig.engine."""
    return engine.model_copy(update={"speculative": speculative})


__all__ = [
    "DEFAULT_DISABLE_ABOVE_BATCH_SIZE",
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "available_proposers",
    "decode_speculation",
    "with_speculation",
]
