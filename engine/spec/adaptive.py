"""How many tokens to draft for a request, from its measured acceptance, and the counters the
engine reports.

Model: each drafted token is accepted with probability a, independently, until the first
rejection. A step drafting k tokens then yields (1 - a^(k+1)) / (1 - a) tokens on average, and
the k-th drafted token adds a^k of them. Adaptive K drafts the k-th token only while a^k reaches
`min_draft_gain`. a is estimated per request from decayed counts: accepted drafted tokens over
tested ones (the accepted, plus the one rejection that ends a step), starting from a prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import SpeculativeConfig
from engine.request import Request

PRIOR_ACCEPTANCE = 0.7  # a of a request before its first verification
PRIOR_WEIGHT = 2.0  # in tested tokens: how fast measurements override the prior
DECAY = 0.8  # per verification step: the weight of older measurements


def acceptance_estimate(request: Request) -> float:
    accepted = request.num_draft_accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    return accepted / (request.num_draft_tested + PRIOR_WEIGHT)


def num_draft_tokens(config: SpeculativeConfig, request: Request) -> int:
    """K for the request's next step, in [1, config.num_draft_tokens]."""
    k_max = config.num_draft_tokens
    if not config.enable_adaptive_draft_length:
        return k_max
    a = acceptance_estimate(request)
    if a >= 1.0:
        return k_max
    if a <= 0.0:
        return 1
    return max(1, min(k_max, math.floor(math.log(config.min_draft_gain) / math.log(a))))


def observe(request: Request, num_drafted: int, num_accepted: int) -> None:
    """Records one verification: num_accepted of num_drafted drafted tokens were accepted."""
    tested = num_accepted + (1 if num_accepted < num_drafted else 0)
    request.num_draft_accepted = DECAY * request.num_draft_accepted + num_accepted
    request.num_draft_tested = DECAY * request.num_draft_tested + tested


@dataclass
class SpecCounters:
    """Since the engine started. Acceptance per drafted token a = num_accepted_tokens /
    (num_accepted_tokens + num_rejections) (the first rejection ends a step; later drafts are not
    tested); tokens per verification = (num_accepted_tokens + num_verifications) / num_verifications."""

    num_draft_tokens: int = 0  # drafted tokens sent to verification
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # request-steps that verified at least one drafted token
    num_rejections: int = 0  # verifications that rejected a drafted token
    num_emitted_tokens: int = 0  # tokens those verifications produced (after stop truncation)

    def record(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        self.num_rejections += int(num_accepted < num_drafted)
        self.num_emitted_tokens += num_emitted
