"""A local Ray cluster for the integration tests (one per session). Never `ray stop`: it would kill
every Ray process on the machine; `ray.shutdown()` ends only ours."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()
