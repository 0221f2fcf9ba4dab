"""A workload to plan for: request lengths, how requests arrive, and the SLOs they must meet."""

from __future__ import annotations

import random
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class SLO(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_ms: float = Field(gt=0, description="Time to first token, per request.")
    tpot_ms: float = Field(gt=0, description="Time per output token after the first, per request.")


class Workload(BaseModel):
    """Prompt and output lengths uniform in their ranges (or the given samples), arriving at a rate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: tuple[int, int] = Field((1000, 4000), description="Uniform range, inclusive.")
    output_tokens: tuple[int, int] = Field((100, 300), description="Uniform range, inclusive.")
    samples: tuple[tuple[int, int], ...] = Field((), description="(prompt, output) pairs drawn instead, if any.")
    arrivals: Literal["poisson", "uniform"] = Field("poisson", description="'uniform': evenly spaced (tests).")
    num_requests: int = Field(600, ge=10, description="Requests simulated per rate.")
    seed: int = 0


class Request(NamedTuple):
    arrival_s: float
    prompt: int
    output: int


def requests(workload: Workload, rate: float) -> list[Request]:
    """The workload's requests at `rate` per second; the same lengths at every rate (one seed)."""
    rng = random.Random(workload.seed)
    lengths = []
    for _ in range(workload.num_requests):
        if workload.samples:
            lengths.append(workload.samples[rng.randrange(len(workload.samples))])
        else:
            lengths.append((rng.randint(*workload.prompt_tokens), rng.randint(*workload.output_tokens)))
    gaps = random.Random(workload.seed + 1)
    t, out = 0.0, []
    for prompt, output in lengths:
        t += gaps.expovariate(rate) if workload.arrivals == "poisson" else 1.0 / rate
        out.append(Request(t, prompt, output))
    return out
