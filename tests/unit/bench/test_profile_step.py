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
