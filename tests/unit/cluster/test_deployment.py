"""Deployment.held_blocks, the leak check every integration test ends with, without Ray: a worker that answers
gives its count, one whose integrity check never answers is a TimeoutError naming it instead of a wait without
end (a CI run once hung at its 600 s limit after a rank was killed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.config import ClusterConfig
from cluster.deployment import Deployment


def _handle(answer: int | None) -> SimpleNamespace:
    async def check() -> int:
        if answer is None:
            await asyncio.Event().wait()  # NOTE: an engine thread that never runs the command
        return answer

    return SimpleNamespace(check_integrity=SimpleNamespace(remote=check))


def _deployment(handles: dict[str, SimpleNamespace]) -> Deployment:
    deployment = Deployment.__new__(Deployment)  # NOTE: no Ray cluster: only the config and the pools' handles are read
    deployment.config = ClusterConfig()
    deployment.prefill, deployment.decode = None, SimpleNamespace(handles=handles)
    return deployment


def test_held_blocks_counts_every_workers_blocks() -> None:
    held = asyncio.run(_deployment({"colocated-0": _handle(0), "colocated-1": _handle(3)}).held_blocks())
    assert held == {"colocated-0": 0, "colocated-1": 3}


def test_held_blocks_names_a_worker_that_does_not_answer() -> None:
    deployment = _deployment({"colocated-0": _handle(0), "colocated-1": _handle(None)})
    with pytest.raises(TimeoutError, match="colocated-1 did not answer its integrity check within 0.2 s"):
        asyncio.run(asyncio.wait_for(deployment.held_blocks(timeout_s=0.2), 3))
