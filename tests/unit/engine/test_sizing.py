"""The GPU KV budget: `gpu_memory_utilization` of the device less the weights and the activation peak, refused
with the setting to change when other processes hold the memory it counts on (arithmetic only: runs on CPU)."""

from __future__ import annotations

import pytest

from engine.sizing import gpu_kv_budget

GIB = 1 << 30


def test_the_budget_is_the_utilization_share_less_weights_and_peak() -> None:
    # 100 GiB device, 16 GiB of weights, 2 GiB activation peak, 83 GiB free.
    assert gpu_kv_budget(0.9, 100 * GIB, 83 * GIB, 16 * GIB, 2 * GIB, "cuda:0") == 90 * GIB - 18 * GIB


def test_a_budget_past_what_is_free_names_the_setting_and_its_largest_safe_value() -> None:
    # Another process holds 40 GiB: 0.9 of the device would ask 72 GiB of KV where only 41 GiB is free.
    with pytest.raises(ValueError) as err:
        gpu_kv_budget(0.9, 100 * GIB, 43 * GIB, 16 * GIB, 2 * GIB, "cuda:1")
    message = str(err.value)
    assert "gpu_memory_utilization=0.9" in message and "cuda:1" in message, message
    assert "43.0 GiB of its 100.0 GiB is free" in message and "hold 41.0 GiB" in message, message
    assert "at most 0.59" in message, message
    # The value the message suggests is accepted, and fills what is free less the peak.
    assert gpu_kv_budget(0.59, 100 * GIB, 43 * GIB, 16 * GIB, 2 * GIB, "cuda:1") <= 41 * GIB


def test_exactly_what_is_free_is_accepted() -> None:
    assert gpu_kv_budget(0.5, 100 * GIB, 34 * GIB, 16 * GIB, 2 * GIB, "cuda:0") == 32 * GIB
