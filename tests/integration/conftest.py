"""A local Ray cluster for the integration tests (one per session). Never `ray stop`: it would kill
every Ray process on the machine; `ray.shutdown()` ends only ours."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture
def ray_cluster() -> Iterator[None]:
    """This process's local Ray cluster, started on first use and kept for later tests (a test
    that needs its own cluster shuts this one down first; the next user starts it again)."""
    if not ray.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
        )
    yield


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_the_end() -> Iterator[None]:
    yield
    if ray.is_initialized():
        ray.shutdown()
