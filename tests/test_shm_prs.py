"""The shm pull requests of upstream_prs/, in merge order: 0001 (fix 1: the released
kernel's path), 0002 and 0003 (sgl-kernel: a group's own segments; a gone rank), 0004
(the caller: bootstrap joins the kernel's group).

Applied in order to a pristine sglang 0.5.23 checkout (the wheel's package as
``python/sglang``, an empty ``test/registered/``; the kernel sources are not in the
wheel, so only the kernel PRs' tests land there), each applies, changes at most 400
lines, deletes no line an earlier one added, and the last leaves every file they touch
as ``scripts/overlay.py`` makes it. With ``SGLANG_CPU_KERNEL`` (a kernel whose
initialize takes a group), each Python PR's own tests fail right before it and pass
right after it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRISTINE = (
    Path(os.environ.get("SGLANG_PRISTINE_DIR") or REPO / ".venv" / "pristine")
    / "sglang"
)
HARNESS = REPO / "tests" / "harness"
PRS = ["0001-cpu-shm-segments", "0002-cpu-shm-group", "0003-cpu-shm-group-liveness",
       "0004-cpu-shm-group-caller"]  # fmt: skip
KERNEL_SOURCES = "python/sglang/kernels/*"
MAX_LINES = 400


def patch(pr: str) -> Path:
    return REPO / "upstream_prs" / pr / "fix.patch"


def files(pr: str) -> list[str]:
    """The paths a PR changes, as ``+++ b/...`` names them."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch(pr).read_text(), flags=re.M)


def git_apply(root: Path, pr: str) -> None:
    done = subprocess.run(
        ["git", "apply", "-p1", f"--exclude={KERNEL_SOURCES}", str(patch(pr))],
        cwd=root, capture_output=True, text=True, timeout=60,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)},
    )  # fmt: skip
    assert done.returncode == 0, f"{pr}: {done.stderr}"


def checkout(where: Path) -> Path:
    (where / "test" / "registered").mkdir(parents=True)
    shutil.copytree(PRISTINE, where / "python" / "sglang", copy_function=os.link)
    return where


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> list[Path]:
    """A pristine checkout, then one more with each PR applied on the one before."""
    roots = [checkout(tmp_path_factory.mktemp("pristine"))]
    for pr in PRS:
        root = tmp_path_factory.mktemp(pr[:4])
        shutil.copytree(roots[-1], root, dirs_exist_ok=True)
        git_apply(root, pr)
        roots.append(root)
    return roots


@pytest.mark.parametrize("pr", PRS)
def test_each_pr_changes_at_most_400_lines(pr):
    text = patch(pr).read_text()
    changed = [
        l for l in text.splitlines() if l[:1] in "+-" and l[:4] not in ("+++ ", "--- ")
    ]
    assert 0 < len(changed) <= MAX_LINES, len(changed)


def test_no_pr_deletes_a_line_an_earlier_one_added():
    added: dict[str, set[str]] = {}
    for pr in PRS:
        path = None
        for line in patch(pr).read_text().splitlines():
            if line.startswith("+++ "):
                path = line[len("+++ b/") :]
            elif line.startswith("-") and not line.startswith("--- "):
                assert line[1:] not in added.get(path, set()), f"{pr}: {path}: {line}"
        for line in patch(pr).read_text().splitlines():
            if line.startswith("+++ "):
                path = line[len("+++ b/") :]
            elif line.startswith("+") and line[1:].strip():
                added.setdefault(path, set()).add(line[1:])


def test_the_last_pr_leaves_what_the_overlay_makes(stages, tmp_path):
    overlaid = checkout(tmp_path / "overlaid")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "overlay.py"), str(overlaid)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    touched = sorted(
        {
            f
            for pr in PRS
            for f in files(pr)
            if not f.startswith("python/sglang/kernels/")
        }
    )
    assert touched  # bootstrap.py, the shm modules, and every PR's tests
    for rel in touched:
        assert (stages[-1] / rel).read_bytes() == (overlaid / rel).read_bytes(), rel


def _run_tests(root: Path, tests: list[str]) -> subprocess.CompletedProcess:
    modules = [t[len("test/") : -len(".py")].replace("/", ".") for t in tests]
    return subprocess.run(
        [sys.executable, "-m", "unittest", *modules],
        cwd=root / "test", capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": f"{root / 'python'}{os.pathsep}{HARNESS}",
             "SGLANG_TEST_MAX_RETRY": "0"},
    )  # fmt: skip


@pytest.mark.parametrize("index", [0, 3])  # 0001 and 0004: the Python PRs
def test_a_python_prs_tests_fail_before_it_and_pass_after_it(stages, index):
    if not os.environ.get("SGLANG_CPU_KERNEL"):
        pytest.skip(
            "set SGLANG_CPU_KERNEL (a kernel built with upstream_prs) to run these"
        )
    tests = [f for f in files(PRS[index]) if f.startswith("test/")]
    before_root = stages[index]
    for test in tests:  # the tests, on the tree before the PR
        (before_root / test).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stages[index + 1] / test, before_root / test)
    try:
        before = _run_tests(before_root, tests)
    finally:
        for test in tests:
            (before_root / test).unlink()
    after = _run_tests(stages[index + 1], tests)
    assert before.returncode != 0 and re.search(
        r"FAILED \((failures|errors)=", before.stderr
    ), before.stderr[-3000:]
    assert after.returncode == 0 and re.search(
        r"^OK$", after.stderr, flags=re.M
    ), after.stderr[-3000:]
    assert "skipped" not in after.stderr.splitlines()[-1]
