"""Smoke test of bench/spec_decode.py: tiny sizes on the CPU, the default model as its own draft
(every draft accepted), into a temporary folder; the JSON's numbers reconcile with the formula."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import spec_decode


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def test_spec_decode_bench_smoke(tmp_path: Path) -> None:
    args = ["--quick", "--device", "cpu", "--num-threads", "1", "--target", "default", "--draft", "default"]
    args += ["--ks", "1", "2", "--num-requests", "2", "--max-tokens", "8", "--large-batch", "2", "--out", str(tmp_path)]
    args += ["--batch1-ks", "1", "2"]
    result = spec_decode.main(args)
    assert result["json"] == str(tmp_path / "spec_decode_cpu.json") and Path(result["png"]).stat().st_size > 0
    record = json.loads(Path(result["json"]).read_text())
    assert record["environment"]["device_name"] and any("smoke run" in n for n in record["notes"])
    for row in record["acceptance"]:
        # The target as its own draft: every draft is accepted, a verification yields K + 1 tokens
        # (7 decode tokens: K + 1 per verification while K + 1 fit, then plain steps).
        assert row["a_per_tested_draft"] == 1.0
        assert row["tokens_per_target_step"] == row["predicted_tokens_per_target_step"] == row["k"] + 1
    # Batch 1 at each of --batch1-ks beside plain decoding; the large batch at the largest K.
    assert sorted((r["batch_size"], r["mode"], r["k"] or 0) for r in record["speed"]) == [
        (1, "plain", 0), (1, "speculative", 1), (1, "speculative", 2), (2, "plain", 0), (2, "speculative", 2)
    ]
    assert all(r["num_decode_tokens"] == r["batch_size"] * 7 for r in record["speed"])
    assert (set(record["speedup"]) == {"1", "2", "1_by_k", "2_by_k", "1_paired_by_k", "2_paired_by_k"}
            and set(record["speedup"]["1_by_k"]) == {"1", "2"})
    assert record["speedup"]["1"] == max(record["speedup"]["1_by_k"].values())
    # Paired per repeat with the plain run beside it: plain over itself is exactly 1.
    assert all(r["paired_speedup"] == 1.0 for r in record["speed"] if r["mode"] == "plain")
    assert all(r["paired_speedup"] > 0 for r in record["speed"])


def test_spec_decode_bench_measures_a_second_drafter_in_the_same_runs(tmp_path: Path) -> None:
    args = ["--quick", "--device", "cpu", "--num-threads", "1", "--target", "default", "--method", "ngram"]
    args += ["--versus", "draft=default", "--ks", "2", "--num-requests", "2", "--max-tokens", "8"]
    args += ["--large-batch", "2", "--out", str(tmp_path), "--profile-batches", "2"]
    record = spec_decode.main(args)
    # The step profile at 2 requests, each mode's phases timed synchronously
    assert [p["batch_size"] for p in record["profiles"]] == [2]
    assert all(record["profiles"][0][mode]["phases_s"]["step"] > 0 for mode in ("plain", "speculative"))
    assert sorted((r["batch_size"], r["method"] or "plain") for r in record["speed"]) == [
        (1, "draft"), (1, "ngram"), (1, "plain"), (2, "draft"), (2, "ngram"), (2, "plain")
    ]
    assert record["workload"]["versus"] == "draft=default"
    # The target as its own draft: every draft is accepted, in the same runs as ngram and plain.
    versus = [r for r in record["speed"] if r["method"] == "draft"]
    assert all(r["spec_acceptance_rate"] == 1.0 and len(r["paired_speedup_all"]) == 1 for r in versus)
    assert set(record["speedup"]) >= {"1_paired_versus_draft", "2_paired_versus_draft"}


def test_spec_decode_bench_refuses_a_versus_it_cannot_build() -> None:
    for bad in (["--method", "draft", "--versus", "draft=x"], ["--method", "ngram", "--versus", "draft"],
                ["--method", "draft", "--versus", "ngram=x"], ["--versus", "eagle=x"]):
        with pytest.raises(SystemExit):
            spec_decode.parse_args(bad)
    assert spec_decode.parse_args(["--versus", "ngram"]).versus_method == "ngram"
