"""engine/sms.py: a device's SM count, None off CUDA, which the launch rules read as no SM count."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import _num_sms
from engine.sms import num_sms


def test_the_cpu_has_no_sm_count() -> None:
    cpu = torch.device("cpu")
    assert num_sms(cpu) is None
    assert _num_sms(cpu) == 8  # the attention backend's fixed figure for interpreted launches
