"""bench.side_by_side without Ray: where each mode's workers go (a pair's prefill and decode workers
on different GPUs), the GPU fraction that fits them, the memory-share check, and each worker's config."""

from __future__ import annotations

import pytest

from bench.side_by_side import ModeSpec, SideBySide
from decode_worker import DecodeWorkerConfig
from engine.llm import engine_config
from prefill_worker import PrefillWorkerConfig

MODES = [
    ModeSpec("colocated", is_disaggregated=False),
    ModeSpec("disaggregated", is_disaggregated=True),
    ModeSpec("again", is_disaggregated=True),
]


def _side_by_side(use_gpus: bool = True, **engine: object) -> SideBySide:
    return SideBySide(MODES, engine_config("default", **engine), "nccl", use_gpus=use_gpus)


def test_a_pairs_prefill_and_decode_workers_are_on_different_gpus():
    placement = _side_by_side(gpu_memory_utilization=0.28).placement()
    assert placement == {
        "gpu0": {"gpu_ids": None, "workers": ["colocated-worker", "disaggregated-prefill", "again-prefill"]},
        "gpu1": {"gpu_ids": None, "workers": ["disaggregated-decode", "again-decode"]},
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
        "colocated-worker", "disaggregated-prefill", "disaggregated-decode", "again-prefill", "again-decode"]}}


def test_mode_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        SideBySide([MODES[0], MODES[0]], engine_config("default"), "gloo", use_gpus=False)


def test_each_worker_is_configured_for_its_role():
    side_by_side = SideBySide(MODES, engine_config("default"), "gloo", use_gpus=False, host="10.0.0.1",
                              transfer_timeout_s=7.0, lease_ttl_s=9.0)
    configs = {s.worker_id: side_by_side._config(s) for s in side_by_side.specs}
    prefill, decode = configs["disaggregated-prefill"], configs["disaggregated-decode"]
    assert type(prefill) is PrefillWorkerConfig and type(decode) is DecodeWorkerConfig
    assert type(configs["colocated-worker"]) is DecodeWorkerConfig
    for config in configs.values():
        assert (config.transport, config.host, config.transfer_timeout_s) == ("gloo", "10.0.0.1", 7.0)
        assert config.engine == side_by_side.engine
    assert decode.lease_ttl_s == 9.0 and decode.worker_id == "disaggregated-decode"
