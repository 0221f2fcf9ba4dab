"""bench.prefill_path on the CPU (the tiny default model, tiny prompts): both modes measured every
round, the KV streamed in the groups asked for (or none without the early handshake), no block held
by any worker after, and the reported difference follows from the rows."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench import prefill_path

MODEL = str(Path(prefill_path.__file__).resolve().parents[1] / "engine" / "models" / "default")


@pytest.mark.parametrize("flags,streamed", [(["--kv-messages", "2"], 2), (["--no-early-handshake"], 0)])
def test_rounds_reconcile_and_nothing_is_held(tmp_path: Path, flags: list[str], streamed: int) -> None:
    path = prefill_path.main(["--model", MODEL, "--device", "cpu", "--prompt-len", "40", "--rounds", "3",
                              "--num-blocks", "64", "--out", str(tmp_path), *flags])
    record = json.loads(path.read_text())
    assert path.with_suffix(".png").stat().st_size > 0
    assert record["device"] == "cpu" and record["rounds"] == 3
    rows = record["rows"]
    assert [len(rows["colocated"]), len(rows["prefill"])] == [3, 3]
    assert set(record["held_blocks_after"].values()) == {0}
    assert [r["num_streamed_messages"] for r in rows["prefill"]] == [streamed] * 3
    for mode_rows in rows.values():
        assert all(0 < r["worker_s"] <= r["ttft_s"] for r in mode_rows)  # the worker's part of what the caller saw
    diff = record["worker_s_difference"]
    assert diff["per_round"] == [p["worker_s"] - c["worker_s"] for p, c in zip(rows["prefill"], rows["colocated"])]
    assert diff["median"] == statistics.median(diff["per_round"]) and diff["ci95_low"] <= diff["ci95_high"]
