"""What an engine measures of its own speed, for the router's choice of where to prefill a prompt
(router/policy.py's SloRule): the time of a step that only decodes, and the prompt tokens a second
it computes in steps that prefill (their time less the decode part). Exponentially weighted, from
the wall time of each `EngineCore.step` call and the counts of the steps it waited for (with
asynchronous scheduling the steps launched before it, not the one it launches: EngineCore._waited).
0.0 means not measured yet."""

from __future__ import annotations

__all__ = ["StepRates"]


class StepRates:
    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.decode_step_s = 0.0
        self.prefill_tokens_per_s = 0.0

    def _blend(self, old: float, new: float) -> float:
        return new if old == 0.0 else (1 - self.weight) * old + self.weight * new

    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        if seconds <= 0.0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_step_s = self._blend(self.decode_step_s, seconds)
            return
        prefill_s = seconds - (self.decode_step_s if decode_rows else 0.0)
        if prefill_s > 0.0:
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, prefill_tokens / prefill_s)
