"""bench.spec_versus_report: two drafters' paired speedups from bench.spec_decode results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import spec_versus_report


def _result(device: str, method: str, versus: str | None, temperature: float) -> dict:
    rows = [{"mode": "plain", "method": None, "batch_size": 1, "paired_speedup": 1.0, "paired_speedup_all": [1.0],
             "spec_acceptance_rate": None, "num_decode_steps": 9}]
    for m, speedup in ((method, 1.2), (versus, 0.9)):
        if m is not None:
            rows.append({"mode": "speculative", "method": m, "batch_size": 1, "paired_speedup": speedup,
                         "paired_speedup_all": [speedup], "spec_acceptance_rate": 0.5, "num_decode_steps": 4})
    return {"environment": {"device_name": device}, "speed": rows,
            "workload": {"method": method, "temperature": temperature, "disable_above_batch_size": 32}}


def test_each_drafters_paired_speedup_per_run(tmp_path: Path) -> None:
    paths = []
    for i, (versus, t) in enumerate((("draft", 0.0), (None, 1.0))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(_result("NVIDIA H200", "ngram", versus, t)))
    record = spec_versus_report.main(["x", *map(str, paths), "--out", str(tmp_path / "out")])
    got = [(r["method"], r["temperature"], r["paired_speedup"]) for r in record["rows"]]
    assert got == [("ngram", 0.0, 1.2), ("draft", 0.0, 0.9), ("ngram", 1.0, 1.2)]
    assert (tmp_path / "out" / "spec_versus_x_nvidia-h200.json").is_file()
    labelled = spec_versus_report.main(["y", *map(str, paths), "--labels", "old", "new", "--out", str(tmp_path)])
    assert [r["label"] for r in labelled["rows"]] == ["old", "old", "new"]
    with pytest.raises(SystemExit):
        spec_versus_report.main(["z", *map(str, paths), "--labels", "old", "--out", str(tmp_path)])


def test_results_of_two_devices_are_refused(tmp_path: Path) -> None:
    for i, device in enumerate(("NVIDIA H200", "NVIDIA H100 80GB HBM3")):
        (tmp_path / f"r{i}.json").write_text(json.dumps(_result(device, "draft", None, 0.0)))
    with pytest.raises(SystemExit):
        spec_versus_report.main(["x", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), "--out", str(tmp_path)])
