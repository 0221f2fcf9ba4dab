"""Every observation the draft gate (engine/spec/gate.py) takes during a bench.spec_decode run (LAB ONLY):
per decode-only step, (batch size, whether it drafted, the step call's milliseconds, output tokens, the
kind the gate asked for at that step: a step of another kind is not counted, and how the draft model
drafted in that step: "chained" (every request adopted the run queued behind the last verification),
"loop" (one loop graph replay), "pass_by_pass" (K forwards and draws launched from the host) or "-"),
written to DIR/gate_log.json beside bench.spec_decode's own results. It wraps DraftGate.observe and
the draft model's propose, _loop and _pass_by_pass for the run; the product is unchanged.

    python -m bench.diag.spec_gate_log DIR --target T --draft D --large-batch 32 --temperature 1 ...

Found (one H200, a pair trained one minute, `spec_gate_diag_pair1min_*`): at batch 32 the gate held
plain decoding after its first 16 drafting steps (T = 0: 452 plain and 33 drafting steps measured),
probing drafting for 5 steps at growing intervals. Its plain steps took as long as the plain engine's
(mean 1.07 against 0.99 ms a step at T = 0, 1.49 against 1.47 at T = 1); the runs lost in their tails,
where requests a probe let run ahead leave small batches whose buckets draft first (T = 0: batches of
4-7 drafted 24 of their 30 measured steps). Again on a 2.5-minute pair (`spec_gate_diag_pair88m_b32_t0_*`):
the kinds tie per step at 32-63 requests, and the tail's drafting steps at 2-15 requests took 2.0-2.8 ms.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench import spec_decode
from engine.spec import gate
from engine.spec.draft_model import DraftModelProposer


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    log: list[tuple[Any, ...]] = []
    how = ["-"]  # how the step being taken drafted
    observe = gate.DraftGate.observe
    propose, loop, pass_by_pass = DraftModelProposer.propose, DraftModelProposer._loop, DraftModelProposer._pass_by_pass

    def recorded(self: gate.DraftGate, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        log.append((batch_size, drafted, round(seconds * 1e3, 3), tokens, self.drafts(batch_size), how[0]))
        how[0] = "-"
        observe(self, batch_size, drafted, seconds, tokens)

    def proposing(self: DraftModelProposer, *args: Any, **kwargs: Any) -> Any:
        how[0] = "chained"  # NOTE: unless it goes on to the loop or pass by pass (below)
        return propose(self, *args, **kwargs)

    def looping(self: DraftModelProposer, *args: Any, **kwargs: Any) -> Any:
        served = loop(self, *args, **kwargs)
        if served:
            how[0] = "loop"
        return served

    def passing(self: DraftModelProposer, *args: Any, **kwargs: Any) -> Any:
        how[0] = "pass_by_pass"
        return pass_by_pass(self, *args, **kwargs)

    patches = {(gate.DraftGate, "observe"): recorded, (DraftModelProposer, "propose"): proposing,
               (DraftModelProposer, "_loop"): looping, (DraftModelProposer, "_pass_by_pass"): passing}
    originals = {key: getattr(*key) for key in patches}
    for (owner, name), patch in patches.items():
        setattr(owner, name, patch)
    try:
        spec_decode.main([*argv, "--out", str(out)])
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    (out / "gate_log.json").write_text(json.dumps(log))


if __name__ == "__main__":
    main()
