"""bench.disagg on the CPU (a subprocess with its own local Ray cluster, gloo, the tiny default
model): colocated and disaggregated run side by side, every mode is measured in every round, the
tokens are equal (the routers reaching the workers over the request channel, a prefill naming its
decode worker by a pickled Ray handle), no block is left held, and the paired overhead follows from
the modes' own TTFTs. The push, which ends after the answer, is timed from the prefill worker's push
records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.paired import overhead_summary

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NUM_TTFT = 5


def test_disagg_cpu_smoke(tmp_path: Path) -> None:
    # NOTE: prompts longer than LocalPrefillConfig.max_short_prompt_tokens (192), or no prefill goes remote
    cmd = [sys.executable, "-m", "bench.disagg", "--device", "cpu", "--transport", "gloo", "--shapes", "default",
           "--shapes-dir", "engine/models", "--prompt-len", "256", "--num-ttft", str(NUM_TTFT), "--iters", "3",
           "--out", str(tmp_path), "--tag", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "disagg_cpu.json").read_text())
    assert (tmp_path / "disagg_cpu.png").stat().st_size > 0
    assert report["num_ttft"] == NUM_TTFT
    shape = report["shapes"]["default"]
    modes = shape["modes"]
    assert set(modes) == {"colocated", "disaggregated"}
    assert shape["same_tokens"] is True
    for mode in modes.values():
        assert len(mode["ttft_s"]) == NUM_TTFT and mode["second_token_median_s"] > 0
        assert set(mode["held_blocks_after"].values()) == {0}
    d, c = modes["disaggregated"], modes["colocated"]
    assert d["push_bytes"] > 0  # the prompts went through the prefill worker
    assert d["push_median_s"] > 0  # timed: after the answer, from the worker's push records
    assert len(d["push_marks_s"]) == NUM_TTFT and all(len(marks) == 3 for marks in d["push_marks_s"])
    assert c["push_bytes"] is None and c["push_marks_s"] == []
    assert shape["push_gbps"] == pytest.approx(d["push_bytes"] / d["push_median_s"] / 1e9)
    assert set(shape["paired_overhead"]) == {"disaggregated"}
    paired = shape["paired_overhead"]["disaggregated"]
    want = overhead_summary(d["ttft_s"], c["ttft_s"], paired["num_resamples"], paired["seed"])
    assert paired == want  # JSON keeps floats exactly
    assert shape["ttft_overhead"] == pytest.approx(d["ttft_median_s"] / c["ttft_median_s"] - 1)
    assert shape["placement"] == {"cpu": {"workers": [
        "colocated-worker", "disaggregated-prefill", "disaggregated-decode"]}}
