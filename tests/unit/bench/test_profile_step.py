"""bench.profile_step --replot: a profile's JSON drawn again (phases, and the device kernels where profiled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import profile_step


def test_replot_draws_the_png_beside_the_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    row = {"batch": 1, "schedule": 1e-5, "runner": 3e-3, "sampler": 4e-4, "post": 1e-5,
           "device_kernels": [{"name": "k", "launches_a_step": 2.0, "us_a_step": 10.0}]}
    path = tmp_path / "profile_step_x.json"
    path.write_text(json.dumps({"environment": {"device_name": "H200", "model": {"name": "m"}}, "context": 1024,
                                "batches": [row, {**row, "batch": 8, "device_kernels": []}]}))
    png = profile_step.replot(path)
    assert png == tmp_path / "profile_step_x.png" and png.stat().st_size > 1000


def test_prompt_steps_compute_prompt_tokens_beside_the_batch(tmp_path: Path, monkeypatch) -> None:
    """--prompt-tokens: after a batch's decode steps, steps computing about that many prompt tokens beside
    its decoding rows are timed (on CPU no kernel table)."""
    monkeypatch.setattr("sys.argv", [
        "profile_step", "--model", "default", "--device", "cpu", "--num-threads", "1", "--attention-backend", "torch",
        "--batches", "2",
        "--context", "16", "--steps", "2", "--top", "0", "--prompt-tokens", "24", "--prompt-len", "12",
        "--prompt-steps", "2", "--max-num-batched-tokens", "26", "--out", str(tmp_path)])
    profile_step.main()
    record = json.loads(next(tmp_path.glob("profile_step_*.json")).read_text())
    steps = record["batches"][0]["prompt_steps"]
    assert steps["decode_rows_a_step"] >= 2  # the batch decodes in the same steps
    assert 0 < steps["prompt_tokens_a_step"] <= 24 and steps["step_s"] > 0
    assert steps["device_kernels"] == []
