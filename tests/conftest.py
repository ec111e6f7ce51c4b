"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for every Ray test of the session, shut down at the end.

    A cluster costs seconds to start and about 1 GB, so the tests share this
    one; each test must leave no actor or placement group of its own behind.
    """
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
