"""bench.steps_side_by_side: each label's mean step over the first label of its model and TP size, repeats
averaged; JSONs from two devices refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import steps_side_by_side


def _json(path: Path, device: str, tp: int, ms: dict[int, float], model: str = "m") -> Path:
    decode = [{"batch": b, "step_s": v / 1e3} for b, v in ms.items()]
    path.write_text(json.dumps({"environment": {"model": {"name": model}},
                                "runs": [{"tp": tp, "device_name": device, "decode": decode}]}))
    return path


def test_means_repeats_and_divides_by_the_first_label_of_the_same_tp(tmp_path: Path, monkeypatch) -> None:
    runs = [("main", _json(tmp_path / "a.json", "H200", 2, {1: 4.0, 8: 5.0})),
            ("main", _json(tmp_path / "b.json", "H200", 2, {1: 2.0, 8: 5.0})),
            ("new", _json(tmp_path / "c.json", "H200", 2, {1: 2.7})),
            ("main", _json(tmp_path / "d.json", "H200", 1, {1: 9.0})),
            ("main", _json(tmp_path / "e.json", "H200", 2, {1: 20.0}, model="b"))]
    args = [a for label, p in runs for a in ("--run", f"{label}={p}")]
    monkeypatch.setattr(sys, "argv", ["x", *args, "--out", str(tmp_path / "out"), "--name", "n"])
    steps_side_by_side.main()
    labels = json.loads((tmp_path / "out" / "n.json").read_text())["labels"]
    assert labels["main m TP=2"]["mean_ms"] == {"1": 3.0, "8": 5.0}
    assert labels["new m TP=2"]["over_baseline"] == {"1": pytest.approx(0.9)}
    assert labels["main m TP=1"]["baseline"] == "main m TP=1" and labels["main m TP=1"]["over_baseline"] == {"1": 1.0}
    assert labels["main b TP=2"]["mean_ms"] == {"1": 20.0}  # another model: its own entry and baseline
    assert labels["main b TP=2"]["baseline"] == "main b TP=2"


def test_refuses_jsons_from_two_devices(tmp_path: Path, monkeypatch) -> None:
    a, b = _json(tmp_path / "a.json", "H200", 2, {1: 4.0}), _json(tmp_path / "b.json", "H100", 2, {1: 4.0})
    monkeypatch.setattr(sys, "argv", ["x", "--run", f"x={a}", "--run", f"y={b}", "--out", str(tmp_path), "--name", "n"])
    with pytest.raises(SystemExit, match="one device call"):
        steps_side_by_side.main()


def test_keeps_each_offline_run_s_output_tokens_per_second(tmp_path: Path, monkeypatch) -> None:
    path = _json(tmp_path / "a.json", "H200", 1, {64: 7.5})
    record = json.loads(path.read_text())
    record["runs"][0].update(variant="fp8", offline={"output_tok_per_s": 13903.0})
    path.write_text(json.dumps(record))
    monkeypatch.setattr(sys, "argv", ["x", "--run", f"new={path}", "--run", f"main={tmp_path / 'b.json'}",
                                      "--out", str(tmp_path / "out"), "--name", "n"])
    _json(tmp_path / "b.json", "H200", 1, {64: 8.6})  # no offline run: no figure
    steps_side_by_side.main()
    labels = json.loads((tmp_path / "out" / "n.json").read_text())["labels"]
    assert labels["new m fp8"]["offline_tok_per_s"] == [13903.0]
    assert "offline_tok_per_s" not in labels["main m TP=1"]
