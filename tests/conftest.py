"""Shared fixtures, and the harness that keeps every interpreter the suite starts light (tests/harness)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

HARNESS = str(Path(__file__).resolve().parent / "harness")

# This process, and every interpreter it starts (spawned ranks, Ray workers, CLI runs), skips
# sglang's own __init__; see tests/harness/sglang_light.py.
sys.path.insert(0, HARNESS)
import sglang_light  # noqa: E402,F401

os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (HARNESS, os.environ.get("PYTHONPATH")) if p
)


def full_import_env() -> dict[str, str]:
    """The environment for an interpreter that imports sglang exactly as users do (no test harness)."""
    env = dict(os.environ)
    paths = [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != HARNESS
    ]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


@contextlib.contextmanager
def setting(name: str, value) -> Iterator[None]:
    """Environment variable ``name`` set for the block and restored on any exit.

    (upstream's ``envs.X.override`` does not restore it when the block raises.)
    """
    saved = os.environ.get(name)
    os.environ[name] = str(int(value)) if isinstance(value, bool) else str(value)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray test of the session, shut down at the end.

    2 CPUs and 4 declared GPUs; its raylet reads a fake /sys whose GPUs sit on
    two NUMA nodes (``ray_gpu_cluster.two_numa_nodes``).

    A cluster costs seconds to start and about 1 GB, so the tests share this
    one; each test must leave no actor or placement group of its own behind.
    Its workers build sglang's stand-in Scheduler (``upstream_standins``).
    """
    import ray_gpu_cluster

    with ray_gpu_cluster.session_cluster() as cluster:
        yield cluster
