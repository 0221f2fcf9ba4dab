"""bench.diag.spec_gate_log on the CPU: each gate observation says how its step drafted, and the
draft model's methods are the product's again afterwards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench.diag import spec_gate_log
from engine.spec.draft_model import DraftModelProposer
from engine.spec.gate import DraftGate


def test_every_observation_says_how_its_step_drafted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (DraftGate.observe, DraftModelProposer.propose, DraftModelProposer._loop)
    threads = torch.get_num_threads()
    argv = ["spec_gate_log", str(tmp_path), "--quick", "--device", "cpu", "--num-threads", "1", "--target", "default",
            "--draft", "default", "--ks", "2", "--num-requests", "2", "--max-tokens", "8", "--large-batch", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        spec_gate_log.main()
    finally:
        torch.set_num_threads(threads)
    log = json.loads((tmp_path / "gate_log.json").read_text())
    assert log and all(len(entry) == 6 for entry in log)
    # On the CPU there is no loop graph and nothing is chained: a drafting step drafts pass by pass
    assert {how for _, drafted, *_, how in log if drafted} == {"pass_by_pass"}
    assert {how for _, drafted, *_, how in log if not drafted} == {"-"}
    assert (DraftGate.observe, DraftModelProposer.propose, DraftModelProposer._loop) == before
