"""A tensor-parallel worker's Ray rank actors each take their own device index (symmetric memory tells the
ranks apart by it): rank r sees every rank's GPU, in rank order, and takes the r-th; rank 0, the worker actor,
keeps Ray's view of its GPU alone (cuda:0, first in every list)."""

from __future__ import annotations

import os

import pytest
import torch

from cluster.ranks import own_gpu, rank_device


def test_rank_r_sees_every_ranks_gpu_in_rank_order_and_takes_the_rth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # as Ray set it: this rank's GPU alone
    assert not torch.cuda.is_initialized()
    assert rank_device("cuda", 2, ("3", "7", "5")) == torch.device("cuda", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,7,5"


def test_without_every_ranks_gpu_a_rank_keeps_rays_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert rank_device("cuda", 1, ()) == torch.device("cuda", 0)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert rank_device("cpu", 1, ("3", "5")) == torch.device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.mark.parametrize("visible, expected", [("4", "4"), ("GPU-1a2b", "GPU-1a2b"), ("0,1", None), ("", None)])
def test_own_gpu_is_the_one_gpu_ray_gave(monkeypatch: pytest.MonkeyPatch, visible: str, expected: str | None) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert own_gpu() == expected
