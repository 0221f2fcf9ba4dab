"""The decode worker's speculative decoding: what it configures, not how it runs.

The proposers (n-gram lookup, draft model) and the verification live in the engine (engine/spec/,
`Sampler.verify`): the engine builds its proposer from `EngineConfig.speculative`, and engine/
imports nothing of ours, so a decode worker speculates when its `DecodeWorkerConfig.engine` says
so, with no code of its own.

In the disaggregated path the draft model needs the prompt's KV too. By default the prefill worker
computes it (its engine config names the same draft; PrefillWorkerConfig.ship_draft_kv) after the
first token, on a CUDA stream of its own, and ships it after the first token; the decode worker
adopts it when its draft is the same model (layout and fingerprint in KvReadyMsg.draft), so its
draft's first step for the request feeds one token instead of the prompt. Otherwise (another
draft, shipping off, a prompt longer than one prefill step, no room in the draft's pool) the
decode worker's draft computes the prompt in its first drafting step, within the step's token
budget. bench.draft_kv measures the two side by side.

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
