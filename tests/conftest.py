"""Shared fixtures, and the harness that keeps every interpreter the suite starts light (tests/harness)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator


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
