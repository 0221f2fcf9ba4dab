"""bench.side_by_side without Ray: where each mode's workers go (a pair's prefill and decode workers
on different GPUs), the GPU fraction that fits them, and the memory-share check."""

from __future__ import annotations

import pytest

from bench.side_by_side import ModeSpec, SideBySide
from engine.llm import engine_config

MODES = [
    ModeSpec("colocated", is_disaggregated=False),
    ModeSpec("one_message", is_disaggregated=True, kv_messages=1),
    ModeSpec("streamed", is_disaggregated=True, kv_messages=8),
]


def _side_by_side(use_gpus: bool = True, **engine: object) -> SideBySide:
    return SideBySide(MODES, engine_config("default", **engine), "nccl", use_gpus=use_gpus)


def test_a_pairs_prefill_and_decode_workers_are_on_different_gpus():
    placement = _side_by_side(gpu_memory_utilization=0.28).placement()
    assert placement == {
        "gpu0": {"gpu_ids": None, "workers": ["colocated-worker", "one_message-prefill", "streamed-prefill"]},
        "gpu1": {"gpu_ids": None, "workers": ["one_message-decode", "streamed-decode"]},
    }


def test_the_workers_of_one_gpu_fit_its_bundle():
    side_by_side = _side_by_side(gpu_memory_utilization=0.28)
    assert side_by_side.max_workers_per_gpu == 3
    assert side_by_side.num_gpus_per_worker == 0.33  # 3 x 0.33 <= 1 in Ray's fixed point


def test_a_memory_share_that_does_not_fit_names_the_limit():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization is 0.4 .* at most 0.317"):
        _side_by_side(gpu_memory_utilization=0.4)
    _side_by_side(gpu_memory_utilization=0.4, num_blocks=64)  # a fixed cache size is the caller's to fit
    _side_by_side(use_gpus=False, gpu_memory_utilization=0.9)  # CPU actors: no GPU to share


def test_on_the_cpu_the_workers_ask_for_no_gpu():
    side_by_side = _side_by_side(use_gpus=False)
    assert side_by_side.num_gpus_per_worker == 0.0
    assert side_by_side.placement() == {"cpu": {"workers": [
        "colocated-worker", "one_message-prefill", "one_message-decode", "streamed-prefill", "streamed-decode"]}}


def test_mode_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        SideBySide([MODES[0], MODES[0]], engine_config("default"), "gloo", use_gpus=False)
