"""Smoke tests of the quantization benchmarks on the CPU (reference paths): bench.quant_quality's
perplexities come from its own sums and their ratios from its own perplexities; bench.quantized runs
each variant in its own process and its speedups and capacity ratios follow from its own figures."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from bench import quant_quality, quantized

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def test_quant_quality_scores_every_variant_on_the_same_windows(hf_checkpoints, tmp_path, monkeypatch) -> None:
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("def main():\n    return sum(range(10))\n" * 40)
    monkeypatch.setattr(sys, "argv", [
        "quant_quality", "--checkpoint", str(hf_checkpoints("llama")), "--held-out", str(held_out), "--device", "cpu",
        "--seq-len", "32", "--max-tokens", "200", "--group", "32", "--out", str(tmp_path),
        "--variants", "bfloat16", "fp8", "fp8-kv", "w4a16-rtn", "gguf-q4k"])
    quant_quality.main()
    record = json.loads(next(tmp_path.glob("quant_quality_*.json")).read_text())
    runs = {r["variant"]: r for r in record["runs"]}
    assert list(runs) == ["bfloat16", "fp8", "fp8-kv", "w4a16-rtn", "gguf-q4k"]
    assert runs["fp8"]["weights"] == "fp8 projections on the reference path"
    assert runs["w4a16-rtn"]["weights"] == "4-bit projections on the reference path"
    base = runs["bfloat16"]
    for r in runs.values():
        assert r["num_tokens"] == base["num_tokens"] == 6 * 32  # 200 tokens: six windows of 33
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
        assert r["perplexity_vs_bfloat16"] == pytest.approx(r["perplexity"] / base["perplexity"])
    assert len({r["loss"] for r in runs.values()}) == 5  # each variant computed its own numbers
    assert next(tmp_path.glob("quant_quality_*.png")).stat().st_size > 0


def test_quantized_variants_side_by_side(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [
        "quantized", "--model", "default", "--device", "cpu", "--num-threads", "1", "--variants", "bfloat16", "fp8",
        "--batches", "1", "2", "--context", "16", "--max-num-seqs", "4", "--max-model-len", "128",
        "--requests", "3", "--isl", "8", "--osl", "4", "--out", str(tmp_path)])
    quantized.main()
    record = json.loads(next(tmp_path.glob("quantized_*.json")).read_text())
    bf16, fp8 = record["runs"]
    assert (bf16["variant"], fp8["variant"]) == ("bfloat16", "fp8")
    assert fp8["weights"] == "fp8 projections on the reference path"
    assert fp8["step_weight_bytes"] < bf16["step_weight_bytes"]
    for row, ref in zip(fp8["decode"], bf16["decode"]):
        assert row["speedup_vs_bfloat16"] == pytest.approx(ref["step_s"] / row["step_s"])
    assert fp8["offline"]["output_tokens"] == bf16["offline"]["output_tokens"] == 3 * 4
    assert fp8["offline"]["speedup_vs_bfloat16"] == pytest.approx(
        fp8["offline"]["output_tok_per_s"] / bf16["offline"]["output_tok_per_s"])
    assert fp8["kv_capacity_vs_bfloat16"] == pytest.approx(fp8["kv_capacity_tokens"] / bf16["kv_capacity_tokens"])
    for run in (bf16, fp8):  # where the offline time went: every prompt token in steps that computed prompt tokens
        steps = run["offline"]["steps"]
        assert steps["prompt"]["prompt_tokens"] == 3 * 8 and steps["decode"]["prompt_tokens"] == 0
        assert steps["prompt"]["steps"] >= 1 and steps["decode"]["steps"] >= 1
        assert 0 < steps["prompt"]["device_s"] + steps["decode"]["device_s"] <= run["offline"]["elapsed_s"]
