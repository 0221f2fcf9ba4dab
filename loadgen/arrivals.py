"""When each request of a run is sent: offsets in seconds from the run's start, with gaps drawn from
a gamma distribution of mean 1 / rate (vLLM's model). Shape (burstiness) 1 is a Poisson process;
below 1 the arrivals bunch into bursts, above 1 they even out. The gaps' coefficient of variation is
1 / sqrt(burstiness). An infinite rate sends everything at once.

Knows nothing of requests or HTTP: the runner sleeps until each offset.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num_requests: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets (s) of NUM_REQUESTS arrivals: the first at 0, each next one a random gap later."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)  # mean gap = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets
