"""bench.sampling_step and bench.spec_controlled (with its lab-only proposer) on the CPU at tiny
sizes: their JSON has every mode and point, seeded runs repeat their tokens, and the controlled
proposer's acceptance is what it was set to at the ends (a = 0: nothing accepted, one token a
verification; a = 1: everything, K + 1 tokens a verification but where max_tokens cuts a draft
short), greedy verification keeping the plain run's tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench import sampling_step, spec_controlled


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def _main(module, monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    monkeypatch.setattr(sys, "argv", [module.__name__, "--device", "cpu", "--num-threads", "1", *args])
    module.main()


def test_sampling_step_records_every_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _main(sampling_step, monkeypatch, ["--batches", "1,2", "--context", "8", "--max-tokens", "6", "--repeats", "2",
                                       "--top", "0", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "sampling_step_cpu.json").read_text())
    assert [b["batch"] for b in record["batches"]] == [1, 2]
    for b in record["batches"]:
        assert set(b["ms_per_step"]) == set(sampling_step.MODES) and b["ratio_to_greedy"]["greedy"] == 1.0
        assert all(len(runs) == 2 for runs in b["ms_per_step_runs"].values())
        assert b["seeded_runs_repeat_their_tokens"] is True


def test_controlled_proposer_accepts_what_it_is_set_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    max_tokens, k = 10, 3
    _main(spec_controlled, monkeypatch, ["--batches", "2", "--context", "8", "--max-tokens", str(max_tokens),
                                         "--accepts", "0.0,1.0", "--ks", str(k), "--repeats", "1",
                                         "--num-blocks", "64", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "spec_controlled_cpu.json").read_text())
    assert "lab-only" in record["proposer"] and "decisive" in record["weights"]
    runs = {r["accept"]: r for r in record["batches"][0]["runs"]}
    assert runs[0.0]["measured_acceptance"] == 0.0 and runs[0.0]["tokens_per_verification"] == 1.0
    assert runs[1.0]["measured_acceptance"] == 1.0
    assert 2.0 < runs[1.0]["tokens_per_verification"] <= k + 1
    assert all(r["outputs_equal_plain"] == "2 of 2" for r in runs.values())
