"""On a CUDA GPU: an asynchronously scheduled engine whose host sleeps between step calls (as a
prefill worker's does while it starts pushes) measures the prompt tokens a second that it measures when
its host calls again at once: each step is timed by CUDA events around its launch
(engine/step_timer.py), not by the host's calls, which here would wait for almost none of the work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# NOTE: a shape whose 2,048-token step the device bounds (about 40 ms on an H200), not the host's launches:
# at the Qwen3-0.6B shape (a 12 ms step) the host launched slower than the device ran, and the same engine
# read 102k-183k prompt tokens/s from run to run
LLAMA_8B_SHAPE = Path(__file__).resolve().parents[2] / "bench" / "shapes" / "llama-3.1-8b"
HOST_SLEEP_S = 0.1  # longer than a 2,048-token prefill step of this shape on an H100 or H200


def measured_prefill_rate(make_llm, async_scheduling: bool, host_sleep_s: float) -> float:
    llm = make_llm(str(LLAMA_8B_SHAPE), device="cuda", dtype="bfloat16", load_format="dummy",
                   attention_backend="triton", num_blocks=2048, max_model_len=4096, max_num_seqs=8,
                   max_num_batched_tokens=2048, async_scheduling=async_scheduling, enforce_eager=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(24):  # 2,047-token prompts: one a step, each step all prompt
        engine.add_request(f"r{i}", [(i * 7919 + j) % 128_000 for j in range(2047)], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        time.sleep(host_sleep_s)
        steps += 1
        assert steps < 200
    assert engine.rates.prefill_tokens_per_s > 0
    return engine.rates.prefill_tokens_per_s


def test_prefill_rate_is_the_devices_whatever_the_host_does_between_steps(make_llm):
    # NOTE: not against a synchronous engine: its steps' events also hold the host's own work within the
    # step (scheduling, reading the tokens), which that engine does pay (at the Qwen3-0.6B shape on one
    # H200: 82k prompt tokens/s against 174k asynchronous). Timed by the host's calls, the sleeping engine's
    # steps would read several times quicker than the device ran them.
    busy = measured_prefill_rate(make_llm, async_scheduling=True, host_sleep_s=0.0)
    sleeping = measured_prefill_rate(make_llm, async_scheduling=True, host_sleep_s=HOST_SLEEP_S)
    print(f"prompt tokens/s, asynchronous: host calling at once {busy:,.0f}, host asleep between calls {sleeping:,.0f}")
    assert sleeping == pytest.approx(busy, rel=0.2)
