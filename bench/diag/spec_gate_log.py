"""Every observation the draft gate (engine/spec/gate.py) takes during a bench.spec_decode run (LAB ONLY):
per decode-only step, (batch size, whether it drafted, the step call's milliseconds, output tokens, the
kind the gate asked for at that step: a step of another kind is not counted), written to DIR/gate_log.json beside bench.spec_decode's own results. It
wraps DraftGate.observe for the run; the product is unchanged.

    python -m bench.diag.spec_gate_log DIR --target T --draft D --large-batch 32 --temperature 1 ...

Found (one H200, a pair trained one minute, `spec_gate_diag_pair1min_*`): at batch 32 the gate held
plain decoding after its first 16 drafting steps (T = 0: 452 plain and 33 drafting steps measured),
probing drafting for 5 steps at growing intervals. Its plain steps took as long as the plain engine's
(mean 1.07 against 0.99 ms a step at T = 0, 1.49 against 1.47 at T = 1); the runs lost in their tails,
where requests a probe let run ahead leave small batches whose buckets draft first (T = 0: batches of
4-7 drafted 24 of their 30 measured steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench import spec_decode
from engine.spec import gate


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    log: list[tuple[Any, ...]] = []
    observe = gate.DraftGate.observe

    def recorded(self: gate.DraftGate, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        log.append((batch_size, drafted, round(seconds * 1e3, 3), tokens, self.drafts(batch_size)))
        observe(self, batch_size, drafted, seconds, tokens)

    gate.DraftGate.observe = recorded  # type: ignore[method-assign]
    try:
        spec_decode.main([*argv, "--out", str(out)])
    finally:
        gate.DraftGate.observe = observe  # type: ignore[method-assign]
    (out / "gate_log.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
