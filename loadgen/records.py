"""RequestRecord: what the client saw of one request (times in seconds from the run's start, token
counts from the server's usage), and the check every record must pass before metrics use it.

Knows nothing of HTTP or of how records become metrics.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any


class RecordError(ValueError):
    """A record that contradicts itself (a first token after the end, times out of order)."""


@dataclass(frozen=True)
class RequestRecord:
    index: int  # the request's position in the workload
    max_tokens: int  # output tokens asked for
    send_time: float  # s from the run's start: the request left the client
    end_time: float  # s: the stream ended ([DONE]), or the request failed
    chunk_times: tuple[float, ...] = field(default_factory=tuple)  # s: each chunk that carried tokens; [0] is TTFT's
    prompt_tokens: int = 0  # from the server's usage; 0 where the request failed
    completion_tokens: int = 0  # from the server's usage; 0 where the request failed
    is_success: bool = False
    http_status: int | None = None  # None: no HTTP answer (refused connection, timeout)
    error: str = ""  # what went wrong, as the server or the client said it

    @property
    def ttft(self) -> float:
        """Time to first token, s: send to the first chunk carrying tokens."""
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        """End-to-end latency, s: send to the end of the stream."""
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, s: (e2e - ttft) / (completion_tokens - 1); None for one token."""
        if self.completion_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies, s: every gap between consecutive token chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("send_time", "end_time"):
            out[key] = round(out[key], 6)
        out["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{**data, "chunk_times": tuple(data.get("chunk_times", ()))})


def check_record(record: RequestRecord) -> None:
    """Raises RecordError, naming the request and the values, unless the record is self-consistent:
    send <= end; and for a success: a first token, send <= chunk times in order <= end (so TTFT <= E2E),
    and at least one completion token counted by the server."""
    r = record
    if r.end_time < r.send_time:
        raise RecordError(f"request {r.index}: end_time {r.end_time:.6f} s is before send_time {r.send_time:.6f} s")
    if r.prompt_tokens < 0 or r.completion_tokens < 0:
        raise RecordError(f"request {r.index}: negative token counts {r.prompt_tokens}, {r.completion_tokens}")
    if not r.is_success:
        return
    if not r.chunk_times:
        raise RecordError(f"request {r.index}: a success with no token chunk (no first token)")
    if r.completion_tokens < 1:
        raise RecordError(f"request {r.index}: a success with completion_tokens={r.completion_tokens} in its usage")
    if r.ttft < 0:
        raise RecordError(f"request {r.index}: first token at {r.chunk_times[0]:.6f} s, before send_time "
                          f"{r.send_time:.6f} s")
    if r.ttft > r.e2e:
        raise RecordError(f"request {r.index}: TTFT {r.ttft * 1e3:.3f} ms > E2E {r.e2e * 1e3:.3f} ms")
    for i, gap in enumerate(r.itls):
        if gap < 0:
            raise RecordError(f"request {r.index}: chunk {i + 1} at {r.chunk_times[i + 1]:.6f} s arrived before "
                              f"chunk {i} at {r.chunk_times[i]:.6f} s")
    if r.chunk_times[-1] > r.end_time:
        raise RecordError(f"request {r.index}: last chunk at {r.chunk_times[-1]:.6f} s is after end_time "
                          f"{r.end_time:.6f} s")
