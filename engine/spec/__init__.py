"""Speculative decoding inside the engine: proposers draft tokens between target steps, and the
engine verifies them in its continuous batch (engine/engine.py, Sampler.verify).

The proposers live here, not in decode_worker/, because the engine builds them from
`EngineConfig.speculative` (so every worker that runs an engine gets speculation from its
configuration alone) and engine/ imports nothing of ours.

Proposers, by `SpeculativeConfig.method`:
- "ngram": prompt lookup (ngram.py), no model.
- "draft": a smaller model of the same tokenizer with its own paged KV cache (draft_model.py).

Knows nothing of the scheduler's queues: a proposer sees `DraftRequest`s and returns `Draft`s.
"""

from engine.request import Draft
from engine.spec import adaptive
from engine.spec.adaptive import SpecCounters
from engine.spec.base import (
    DraftRequest,
    Proposer,
    ProposerContext,
    available_proposers,
    build_proposer,
    register_proposer,
)
from engine.spec.draft_model import DraftModelProposer
from engine.spec.ngram import NgramProposer

__all__ = [
    "Draft",
    "DraftModelProposer",
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "ProposerContext",
    "SpecCounters",
    "adaptive",
    "available_proposers",
    "build_proposer",
    "register_proposer",
]
