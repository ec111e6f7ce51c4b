"""sglang's own linters find nothing in the operator tools, and a finding fails the check."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "lint.sh"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_tools_are_clean():
    done = lint()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_finding_fails_the_check(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import os,sys  # an unsorted, unformatted lien\n")
    done = lint(str(tmp_path))
    assert done.returncode == 1
    found = done.stdout + done.stderr
    for needle in ("would reformat", "incorrectly sorted", "F401", "lien ==> line"):
        assert needle in found, found
