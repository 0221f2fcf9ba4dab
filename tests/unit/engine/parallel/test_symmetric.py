"""The symmetric-memory all-reduce is a CUDA path only: on the CPU it is not built, and a group's
all-reduces stay on its device group (gloo), in place (tests/gpu/test_symmetric_allreduce_gpu.py checks
the kernels on two GPUs)."""

from __future__ import annotations

import threading

import torch

from engine.parallel.group import GroupAddress, TPGroup, host_store
from engine.parallel.symmetric import SymmetricAllReduce, takes_fused_norm


def test_it_is_not_built_off_cuda() -> None:
    store = host_store("127.0.0.1")
    assert SymmetricAllReduce.build("cpu-group", 0, 1, store, None, torch.device("cpu")) is None


def test_a_cpu_group_sums_in_place_over_gloo() -> None:
    store = host_store("127.0.0.1")
    address = GroupAddress("127.0.0.1", store.port)
    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        group = TPGroup(address, r, 2, torch.device("cpu"), store=store if r == 0 else None)
        assert not group.reduces_symmetrically
        x = torch.full((3, 4), float(r + 1))
        out = group.all_reduce(x)
        assert out is x  # the device group's path sums in place
        results[r] = out
        group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(results[0], torch.full((3, 4), 3.0)) and torch.equal(results[1], results[0])


def test_the_fused_norm_takes_rows_within_the_one_shot_size_and_the_signal_pads() -> None:
    row = 4096 * 2  # one bfloat16 row of the 8B shape
    assert takes_fused_norm(1, row, 2, 2048) and takes_fused_norm(32, row, 2, 2048)  # a decode step's rows
    assert not takes_fused_norm(33, row, 2, 1 << 20)  # past the one-shot size: the all-reduce, then the norm
    assert not takes_fused_norm(1, row, 3, 1 << 20)  # not a power-of-two group
    assert not takes_fused_norm(0, row, 2, 2048)
    # a small model's prefill chunk: within the one-shot size, but a flag per row and rank overflows a pad
    assert takes_fused_norm(256, 128, 2, 2048) and not takes_fused_norm(257, 128, 2, 2048)
    assert not takes_fused_norm(256, 128, 4, 2048) and takes_fused_norm(256, 128, 4, 9216)
