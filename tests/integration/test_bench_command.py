"""`pdserve bench` against a real `pdserve serve` (a subprocess with its own local Ray cluster,
disaggregated 1 prefill + 1 decode over gloo, on the CPU): a short Poisson run whose JSON must
reconcile, whose completion tokens (from the server's usage) must be what was asked, with
TTFT <= E2E for every request, and whose PNG must exist. Then a short chat run over text prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_serve_command import KEY, ROOT, Server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_PROMPTS, OUTPUT_LEN = 12, 16


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()  # disaggregated 1P1D over gloo on the CPU, free ports, its own Ray cluster
    yield s
    s.stop()


def _bench(server: Server, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "deploy.cli", "bench", "--base-url", f"http://127.0.0.1:{server.port}/v1",
           "--api-key", KEY, "--no-progress", *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _check(doc: dict, num_prompts: int, output_len: int) -> dict:
    (run,) = doc["runs"]
    m, records = run["metrics"], run["records"]
    assert m["num_sent"] == m["num_completed"] + m["num_errored"] == len(records) == num_prompts
    assert m["num_errored"] == 0 and m["errors"] == {} and run["num_not_sent"] == 0
    for r in records:
        assert r["is_success"] and r["http_status"] == 200
        assert r["completion_tokens"] == output_len  # the server's usage: ignore_eos ran each to max_tokens
        assert r["prompt_tokens"] > 0
        ttft, e2e = r["chunk_times"][0] - r["send_time"], r["end_time"] - r["send_time"]
        assert 0 < ttft <= e2e
    assert m["num_off_length"] == 0
    assert m["total_completion_tokens"] == num_prompts * output_len
    assert m["output_token_throughput"] == pytest.approx(m["total_completion_tokens"] / m["duration_s"])
    assert m["total_token_throughput"] == pytest.approx(
        (m["total_prompt_tokens"] + m["total_completion_tokens"]) / m["duration_s"])
    return m


def test_bench_poisson_run_against_pdserve(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _bench(server, "--num-prompts", str(NUM_PROMPTS), "--request-rate", "4", "--input-len", "24:40",
                  "--output-len", str(OUTPUT_LEN), "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000",
                  "--out", str(out), "--label", "pdserve 1P1D, CPU, integration test")
    assert "sent 12 = completed 12 + errored 0" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "loadgen" and doc["environment"]["label"].startswith("pdserve 1P1D")
    m = _check(doc, NUM_PROMPTS, OUTPUT_LEN)
    assert 24 * NUM_PROMPTS <= m["total_prompt_tokens"] <= 40 * NUM_PROMPTS  # token-id prompts: exact lengths
    assert m["num_good"] == NUM_PROMPTS and m["goodput"] == pytest.approx(NUM_PROMPTS / m["duration_s"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_chat_text_prompts(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "chat.json"
    _bench(server, "--endpoint", "chat", "--prompt-format", "text", "--num-prompts", "4", "--max-concurrency", "2",
           "--input-len", "8", "--output-len", "6", "--out", str(out))
    _check(json.loads(out.read_text()), 4, 6)
