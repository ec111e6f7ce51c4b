"""Fake host trees for the operator tools' tests: ``fakesys`` trees as a capture of
such a host holds them, and a runner of the tools' CLI.

``lscpu`` (which sglang's ``parse_lscpu_topology`` runs) needs each CPU's
``topology/core_siblings`` mask, which a live kernel has and ``fakesys`` does not
write: ``write_tree`` adds it from ``core_siblings_list``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

import fakesys

TOOLS = ["-m", "sglang.srt.placement_tools"]
HERE = Path(__file__).resolve().parent
# The checkout whose tools run: this one, or another (an older cut, to compare),
# named by PLACEMENT_TOOLS_TREE: its .venv runs them, with its own test harness.
TREE = Path(os.environ.get("PLACEMENT_TOOLS_TREE", HERE.parent)).resolve()
PYTHON = sys.executable if TREE == HERE.parent else str(TREE / ".venv/bin/python")
HARNESS = str(TREE / "tests/harness")


def write_tree(root: Path, spec) -> Path:
    """``spec``'s sysfs tree (fakesys) under ``root``, with ``core_siblings``."""
    tree = fakesys.write_sysfs(root, spec)
    width = len(list((tree / "devices/system/cpu").glob("cpu[0-9]*")))
    for topology in (tree / "devices/system/cpu").glob("cpu[0-9]*/topology"):
        listed = (topology / "core_siblings_list").read_text().strip()
        cpus = set()
        for part in listed.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
        mask = fakesys._mask(frozenset(cpus), max(width, max(cpus) + 1))
        (topology / "core_siblings").write_text(mask + "\n")
    return tree


def run_tools(
    argv: Sequence[str],
    *,
    env: Optional[Mapping[str, Optional[str]]] = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python -m sglang.srt.placement_tools ARGV`` (TREE's), with TREE's harness;
    ``env`` entries set (None: removed) on top of this process's environment."""
    full = {**os.environ, "PYTHONPATH": HARNESS}
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return subprocess.run(
        [PYTHON, *TOOLS, *argv],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ranks(done: subprocess.CompletedProcess) -> list[dict]:
    """The rows a ``--json`` run printed (the run must have succeeded)."""
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout)["ranks"]


def run_together(
    jobs: Mapping[str, tuple[Sequence[str], Optional[Mapping[str, Optional[str]]]]],
    *,
    workers: int = 3,
) -> dict[str, subprocess.CompletedProcess]:
    """Each job's ``run_tools(argv, env=env)``, ``workers`` at a time: every run
    imports torch (as sglang's placement does), which is most of its time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        futures = {
            name: pool.submit(run_tools, argv, env=env)
            for name, (argv, env) in jobs.items()
        }
        return {name: future.result() for name, future in futures.items()}
