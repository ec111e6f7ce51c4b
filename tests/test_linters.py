"""sglang's own linters pass on every file the overlay writes and on the ported upstream tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "lint.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_sglangs_black_isort_and_codespell_find_nothing():
    done = lint()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_finding_fails_the_check(tmp_path):
    python = tmp_path / "python"
    shutil.copytree(REPO / "python", python)
    module = python / "sglang" / "srt" / "placement" / "settings.py"
    module.write_text(
        module.read_text() + "\nimport os,sys  # an unsorted, unformatted lien\n"
    )
    done = lint(str(python))
    assert done.returncode == 1
    for needle in (
        "would reformat",
        "settings.py",
        "Imports are incorrectly sorted",
        "lien ==> line",
    ):
        assert needle in done.stdout + done.stderr, done.stdout + done.stderr
