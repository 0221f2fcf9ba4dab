"""What an engine measures of its own speed, for the router's choice of where to prefill a prompt
(router/policy.py's SloRule), the step budget and the autoscaler's pressures: the time of a step that
only decodes, and the prompt tokens a second it computes in steps that prefill (their time less the
decode part). Each is the median of its last `window` observations, each launched step's device
time (engine/step_timer.py) with its counts. A median, not a running
mean: one slow step (a first NCCL transfer, a compile, a collection pause) would otherwise hold the
figure up for as many steps as the mean takes to forget it, and a decode worker busy prefilling
takes few decode-only steps. 0.0 means not measured yet."""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepRates"]


class StepRates:
    def __init__(self, window: int = 16) -> None:
        self._decode_s: deque[float] = deque(maxlen=window)
        self._prefill_rates: deque[float] = deque(maxlen=window)
        self.decode_step_s = 0.0
        self.prefill_tokens_per_s = 0.0
        self.num_prompt_tokens = 0  # computed since start: its differences are the prompt load (the autoscaler's)
        self.device_seconds = 0.0  # every timed step's device time, since start: its differences are the busy share

    def observe(self, seconds: float, prefill_tokens: int, decode_rows: int) -> None:
        self.num_prompt_tokens += prefill_tokens
        if seconds <= 0.0:
            return
        self.device_seconds += seconds
        if prefill_tokens == 0:
            if decode_rows:
                self._decode_s.append(seconds)
                self.decode_step_s = statistics.median(self._decode_s)
            return
        prefill_s = seconds - (self.decode_step_s if decode_rows else 0.0)
        if prefill_s > 0.0:
            self._prefill_rates.append(prefill_tokens / prefill_s)
            self.prefill_tokens_per_s = statistics.median(self._prefill_rates)
