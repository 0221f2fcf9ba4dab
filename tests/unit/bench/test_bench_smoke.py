"""Smoke tests of the benchmarks: each main() runs with --quick and tiny sizes on the CPU into a
temporary folder, and its JSON has the fields, counts that reconcile, and ratios that follow
from its own numbers. The benchmarks check themselves for leaked KV blocks after every run."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import batching, kv_cache_speed

# NOTE: one torch thread: tiny models gain nothing from more, and they stall on a busy machine.
COMMON = ["--quick", "--device", "cpu", "--model", "default", "--num-threads", "1"]


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """--num-threads sets torch's thread count for the whole process: give the next tests theirs back."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def _load(result: dict, tmp_path: Path, stem: str) -> dict:
    json_path, png_path = tmp_path / f"{stem}.json", tmp_path / f"{stem}.png"
    assert result["json"] == str(json_path) and result["png"] == str(png_path)
    assert png_path.stat().st_size > 0
    record = json.loads(json_path.read_text())
    env = record["environment"]
    assert env["device"] == "cpu" and env["device_name"] and env["torch_version"] and env["date"]
    assert env["model"]["num_layers"] >= 1 and env["model"]["hidden_size"] >= 1 and env["model"]["num_params"] > 0
    return record


def test_batching_counts_and_ratio(tmp_path: Path) -> None:
    num_requests, num_slots, short, long = 6, 2, 3, 7
    sizes = ["--num-requests", str(num_requests), "--num-slots", str(num_slots), "--prompt-len", "8"]
    sizes += ["--short-tokens", str(short), "--long-tokens", str(long)]
    result = batching.main([*COMMON, *sizes, "--out", str(tmp_path), "--repeats", "2"])
    record = _load(result, tmp_path, "batching_cpu")
    work = record["workload"]
    assert work["max_tokens"] == [short, long] * (num_requests // 2)
    expected_tokens = sum(work["max_tokens"])
    results = record["results"]
    for mode in ("static", "continuous"):
        r = results[mode]
        assert r["num_requests"] == num_requests
        assert r["num_output_tokens"] == expected_tokens  # ignore_eos: every request runs to max_tokens
        assert len(r["wall_s_all"]) == 2 and r["wall_s"] in r["wall_s_all"] and r["wall_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(expected_tokens / r["wall_s"])
        assert r["requests_per_s"] == pytest.approx(num_requests / r["wall_s"])
        assert 1 <= r["mean_batch_size"] <= num_slots and r["num_preemptions"] == 0
    # static: each batch of 2 (one short, one long) runs as long as its long request
    assert results["static"]["num_steps"] == (num_requests // num_slots) * long
    # continuous: never worse than static, never better than full slots every step
    num_steps = results["continuous"]["num_steps"]
    assert math.ceil(expected_tokens / num_slots) <= num_steps <= results["static"]["num_steps"]
    ratio = record["ratio_continuous_over_static"]
    for field in ("tokens_per_s", "requests_per_s", "num_steps"):
        assert ratio[field] == pytest.approx(results["continuous"][field] / results["static"][field])


def test_kv_cache_speed_fields_and_ratio(tmp_path: Path) -> None:
    result = kv_cache_speed.main([*COMMON, "--context-len", "24", "--num-decode", "4", "--out", str(tmp_path)])
    record = _load(result, tmp_path, "kv_cache_speed_cpu")
    assert record["workload"]["context_lens"] == [25, 26, 27, 28]
    cached, recompute = record["results"]["cached"], record["results"]["recompute"]
    assert len(cached["step_s"]) == len(recompute["token_s"]) == 4
    assert all(s > 0 for s in cached["step_s"] + recompute["token_s"]) and cached["prefill_s"] > 0
    assert min(cached["step_s"]) <= cached["median_s_per_token"] <= max(cached["step_s"])
    assert min(recompute["token_s"]) <= recompute["median_s_per_token"] <= max(recompute["token_s"])
    assert recompute["num_tokens_matching_cached"] == 4  # float32 on CPU: recomputing gives the same greedy token
    expected_ratio = recompute["median_s_per_token"] / cached["median_s_per_token"]
    assert record["ratio_recompute_over_cached"] == pytest.approx(expected_ratio)
    assert record["num_preemptions"] == 0


def test_kv_cache_speed_rejects_a_context_longer_than_the_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--context-len"):
        kv_cache_speed.main([*COMMON, "--context-len", "5000", "--out", str(tmp_path)])
