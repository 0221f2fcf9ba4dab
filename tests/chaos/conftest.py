"""The chaos suite's local Ray cluster (one per session) and its markers. Never `ray stop`: it
would kill every Ray process on the machine; `ray.shutdown()` ends only ours."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")


def pytest_configure(config: pytest.Config) -> None:
    # NOTE: also belongs in pyproject's markers list; registered here so --strict-markers passes either way.
    config.addinivalue_line("markers", "chaos: injects faults (worker deaths, transfer faults) into a Ray cluster")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """Module-scoped, and shut down only if started here, so that it never clashes with the
    integration suite's session cluster in the same pytest run."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    is_ours = not ray.is_initialized()
    if is_ours:
        ray.init(
            address="local",  # a cluster of our own even when another runs on this machine
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,  # the workers' fault warnings are expected; the figures go to the JSON
            runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
        )
    yield
    if is_ours:
        ray.shutdown()
