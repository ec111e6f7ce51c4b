"""overlay.py --series: the change as a patch series that applies in order onto a pristine sglang 0.5.23.

The series is built from the pristine package, applied patch by patch with
``git apply -p1`` from the package's parent, and the result compared with what
``overlay.py`` makes. After each patch that changes an upstream module, the
modules sglang's own code reaches (numa_utils, bootstrap, ray.engine) must
import from the patched tree; a patch that only adds new modules changes
nothing those imports load.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "scripts" / "overlay.py"
PRISTINE = (
    Path(os.environ.get("SGLANG_PRISTINE_DIR") or REPO / ".venv" / "pristine")
    / "sglang"
)
HARNESS = REPO / "tests" / "harness"
UPSTREAM_FILES = {
    "srt/environ.py",
    "srt/utils/numa_utils.py",
    "srt/ray/scheduler_actor.py",
    "srt/ray/engine.py",
    "srt/distributed/bootstrap.py",
}
IMPORTS = (
    "import sglang.srt.utils.numa_utils, sglang.srt.distributed.bootstrap, "
    "sglang.srt.ray.engine"
)


def copy_pristine(where: Path) -> Path:
    where.mkdir()
    shutil.copytree(
        PRISTINE, where / "sglang", ignore=shutil.ignore_patterns("__pycache__")
    )
    return where / "sglang"


def touched(patch: Path) -> set[str]:
    paths = re.findall(r"^\+\+\+ b/sglang/(\S+)$", patch.read_text(), flags=re.M)
    return set(paths)


def same_tree(a: Path, b: Path) -> list[str]:
    """Paths that differ between two trees, manifest and bytecode left out."""
    skip = {"__pycache__", ".placement-overlay.json"}
    found = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        found.extend(
            f"{rel}{n}" for n in cmp.left_only + cmp.right_only if n not in skip
        )
        found.extend(f"{rel}{n}" for n in cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            if name not in skip:
                walk(sub, f"{rel}{name}/")

    walk(filecmp.dircmp(a, b, ignore=list(skip)), "")
    return found


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    out = tmp_path_factory.mktemp("series") / "out"
    before = same_tree(PRISTINE, PRISTINE)
    done = subprocess.run([sys.executable, str(OVERLAY), "--series", str(out), str(PRISTINE)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert before == [] and not (PRISTINE / ".placement-overlay.json").exists()
    return out, done.stdout


def test_the_series_lists_its_patches_in_order_each_one_idea_of_at_most_800_lines(
    series,
):
    out, summary = series
    names = out.joinpath("series").read_text().split()
    assert names == sorted(p.name for p in out.glob("*.patch"))
    assert [n[:4] for n in names] == [f"{i:04d}" for i in range(1, len(names) + 1)]
    for name, line in zip(names, summary.splitlines()):
        text = (out / name).read_text()
        head, _, diff = text.partition("\n---\n")
        assert head.startswith(f"Subject: [PATCH {int(name[:4])}/{len(names)}] ")
        assert "\nTests: " in head and "\nOperators notice: " in head
        changed = [
            line
            for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
        ]
        assert 0 < len(changed) <= 800, (name, len(changed))
        assert name in line and f"{len(changed)} lines" in line


def test_the_patches_apply_in_order_and_end_as_the_overlay(series, tmp_path):
    out, _ = series
    applied = copy_pristine(tmp_path / "applied")
    made = copy_pristine(tmp_path / "made")
    checked = 0
    for name in out.joinpath("series").read_text().split():
        patch = out / name
        done = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=applied.parent,
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, f"{name}: {done.stderr}"
        if touched(patch) & UPSTREAM_FILES:
            env = {**os.environ, "PYTHONPATH": f"{applied.parent}{os.pathsep}{HARNESS}"}
            imported = subprocess.run([sys.executable, "-c", f"{IMPORTS}; print('ok')"],
                                      env=env, capture_output=True, text=True, timeout=300,
                                      cwd=tmp_path)  # fmt: skip
            assert imported.stdout.strip().endswith(
                "ok"
            ), f"{name}: {imported.stderr[-3000:]}"
            checked += 1
    assert checked >= 5
    done = subprocess.run([sys.executable, str(OVERLAY), str(made)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert same_tree(applied, made) == []


def test_series_refuses_a_package_that_holds_an_overlay_and_a_non_empty_out(tmp_path):
    package = copy_pristine(tmp_path / "pkg")
    subprocess.run([sys.executable, str(OVERLAY), str(package)], check=True,
                   capture_output=True)  # fmt: skip
    done = subprocess.run([sys.executable, str(OVERLAY), "--series", str(tmp_path / "out"),
                           str(package)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "needs a pristine sglang package" in done.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    done = subprocess.run([sys.executable, str(OVERLAY), "--series", str(busy), str(PRISTINE)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1 and "is not empty" in done.stderr
