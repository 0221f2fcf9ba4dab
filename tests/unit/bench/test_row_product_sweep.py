"""bench.diag.row_product_sweep's plot from a committed result's fields (no GPU): a PNG beside the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.diag import row_product_sweep


def test_plot_draws_a_png_beside_the_result(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"shape": "8b_o", "floor_us": 8.2, "cublas_us": 14.0, "served_us": 12.1,
             "best": {"config": [16, 512, 4, 3], "us": 10.8}}]
    result = tmp_path / "row_product_sweep_gpu.json"
    result.write_text(json.dumps({"device_name": "NVIDIA H200", "rows": rows}))
    row_product_sweep.plot(result)
    assert result.with_suffix(".png").stat().st_size > 1000
