"""BenchConfig: one frozen, validated description of a load-generator run (or sweep). The command
line takes its flags, defaults and help from this model; bad values raise naming the field.

Knows nothing of HTTP, clocks or files: it only says what to send, how fast, and what counts as good.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PERCENTILES = (50, 90, 99)
"""The percentiles every latency is reported at (with the mean); 50 is the median."""


def parse_range(value: Any) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256), inclusive; an int or a 2-sequence as is."""
    if isinstance(value, bool):  # NOTE: ValueError: pydantic reports only it (not TypeError) as a field error
        raise ValueError(f"expected N or MIN:MAX, got {value!r}")  # noqa: TRY004
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, str):
        parts = value.split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"expected N or MIN:MAX (whole numbers), got {value!r}")
        low, high = int(parts[0]), int(parts[-1])
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        low, high = int(value[0]), int(value[1])
    else:
        raise ValueError(f"expected N or MIN:MAX, got {value!r}")
    if not 1 <= low <= high:
        raise ValueError(f"needs 1 <= MIN <= MAX, got {low}:{high}")
    return low, high


class BenchConfig(BaseModel):
    """What `pdserve bench` sends, at what pace, and the SLOs that define goodput."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ---- the server
    base_url: str = Field("http://127.0.0.1:8000/v1", description="OpenAI base URL, as the openai client takes it.")
    api_key: str | None = Field(None, description="Sent as 'Authorization: Bearer KEY'; unset: none.")
    model: str = Field("default", description="The 'model' field of every request.")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="/v1/completions or /v1/chat/completions (chat needs text prompts)."
    )
    ignore_eos: bool = Field(
        True, description="Send ignore_eos: true so every request runs to max_tokens (vLLM's extra field)."
    )
    temperature: float | None = Field(None, ge=0.0, description="Sampling temperature; unset: the server's default.")
    request_timeout: float = Field(600.0, gt=0, description="Seconds one request may take before it counts as failed.")

    # ---- the workload
    workload: Literal["random", "prefix", "jsonl"] = Field(
        "random",
        description="random: random prompts; prefix: NUM_PREFIXES shared prefixes of PREFIX_LEN tokens, each "
        "request one of them + a unique suffix of INPUT_LEN; jsonl: --dataset, one JSON object a line.",
    )
    prompt_format: Literal["tokens", "text"] = Field(
        "tokens", description="tokens: token-id lists (exact lengths; completions only); text: random words "
        "(about one token a word; the server's usage gives the real count).",
    )
    input_len: tuple[int, int] = Field((128, 128), description="Prompt tokens (the suffix, for prefix): N or MIN:MAX.")
    output_len: tuple[int, int] = Field((128, 128), description="max_tokens of each request: N or MIN:MAX.")
    num_prefixes: int = Field(4, ge=1, description="Shared prefixes of the prefix workload.")
    prefix_len: int = Field(512, ge=1, description="Tokens of each shared prefix.")
    vocab_size: int = Field(
        2048, ge=2, description="Token ids are drawn from [0, VOCAB_SIZE) (default: pdserve's default model's)."
    )
    dataset: Path | None = Field(None, description='JSONL file: {"prompt": str | [ids], "max_tokens": int} a line.')
    num_prompts: int = Field(100, ge=1, description="Requests in a run (at most, for jsonl).")
    seed: int = Field(0, description="Seed of prompts, lengths and arrivals (a sweep's k-th rate uses SEED + k).")

    # ---- the traffic
    request_rate: float = Field(math.inf, gt=0, description="Requests per second; inf sends them all at once.")
    burstiness: float = Field(
        1.0, gt=0, description="Gamma shape of the gaps between arrivals: 1 is Poisson, < 1 burstier, > 1 steadier."
    )
    max_concurrency: int | None = Field(None, ge=1, description="Most requests in flight at once (unset: no limit).")
    duration: float | None = Field(
        None, gt=0, description="Seconds a run may last: no request starts after it, and those in flight fail."
    )
    sweep_rates: tuple[float, ...] | None = Field(
        None, description="Comma-separated request rates: one run at each (replaces --request-rate)."
    )

    # ---- what is good, and where results go
    slo_ttft_ms: float | None = Field(None, gt=0, description="Goodput SLO: time to first token, in ms.")
    slo_tpot_ms: float | None = Field(None, gt=0, description="Goodput SLO: time per output token, in ms.")
    out: Path | None = Field(None, description="JSON results file; the PNG plots go beside it (same stem).")
    label: str = Field("", description="What ran where (server, device, model): titles the plots and the JSON.")
    is_progress: bool = Field(True, description="Draw a progress bar on stderr.")

    @field_validator("input_len", "output_len", mode="before")
    @classmethod
    def _range(cls, value: Any) -> tuple[int, int]:
        return parse_range(value)

    @field_validator("sweep_rates", mode="before")
    @classmethod
    def _rates(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = tuple(float(v) for v in value.split(",") if v.strip())
            except ValueError:
                raise ValueError(f"expected comma-separated numbers like 1,2,4, got {value!r}") from None
        if value is not None and (not value or any(not r > 0 for r in value)):
            raise ValueError(f"expected one or more rates > 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BenchConfig:
        if self.workload == "jsonl" and self.dataset is None:
            raise ValueError("workload 'jsonl' needs --dataset FILE")
        if self.workload != "jsonl" and self.dataset is not None:
            raise ValueError(f"--dataset is read only by workload 'jsonl', not {self.workload!r}")
        if self.endpoint == "chat" and self.workload != "jsonl" and self.prompt_format == "tokens":
            raise ValueError("endpoint 'chat' takes text: pass --prompt-format text (token ids need 'completions')")
        return self

    @property
    def rates(self) -> tuple[float, ...]:
        """The request rate of each run: the sweep's, or the one --request-rate."""
        return self.sweep_rates or (self.request_rate,)

    @property
    def has_slo(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_tpot_ms is not None
