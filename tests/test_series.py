"""overlay.py --series: the upstream fixes as their own pull requests, then the refactor
as diffs between trees, the operator tools last, onto a pristine sglang 0.5.23.

Built on a checkout made from the pristine package: its ``python/sglang`` and a
``test/`` holding an empty ``registered/``. Upstream's own ``test/`` tree is not part
of the package, so every test a patch carries is a new file here. Each fix applies
alone with ``git apply -p1``, changes at most 250 lines, its tests fail on the
checkout without its code and pass with it, and upstream's linters are clean on what
it touches. The whole series applies in order, the upstream-layout tests each patch
adds or changes pass right after it (run with ``unittest``, as upstream's CPU suite
runs them), and the last leaves exactly what ``overlay.py CHECKOUT`` makes.
"""

from __future__ import annotations

import ast
import filecmp
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import overlay  # noqa: E402
import overlay_series  # noqa: E402

OVERLAY = REPO / "scripts" / "overlay.py"
PRISTINE = (
    Path(os.environ.get("SGLANG_PRISTINE_DIR") or REPO / ".venv" / "pristine")
    / "sglang"
)
HARNESS = REPO / "tests" / "harness"
FIXES = overlay_series.fixes(REPO / overlay_series.FIXES)
TOOLS = overlay_series.PARTS[-1][2]
MAX_FIX_LINES = 250
MAX_TOOL_LINES = 300
TESTS_TIMEOUT_S = 300
SKIP = {"__pycache__", ".placement-overlay.json"}
LINTERS = (  # upstream's pre-commit linters, as scripts/lint.sh runs them
    ("black", "--check"),
    ("isort", "--check-only", "--profile", "black", "-p", "sglang"),
    ("ruff", "check", "--no-cache", "--isolated", "--select=F401"),
    ("codespell_lib", "-L", "cann,thi,makro,wil,rouge,PRIS"),
)


def run(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs
    )


def copy_tree(source: Path, dest: Path, *options: str) -> Path:
    """A copy of ``source``; ``-l`` links its files (git apply and the overlay
    replace a file, never write through it)."""
    assert run("cp", "-R", *options, source, dest).returncode == 0
    return dest


def touched(patch: Path) -> list[str]:
    return [path for _, _, path in overlay_series.numstat(patch)]


def changed(diff: str) -> int:
    """Lines added and removed, counted on the text: every +/- line but the headers."""
    lines = diff.splitlines()
    files = sum(1 for line in lines if line.startswith("+++ "))
    return sum(1 for line in lines if line[:1] in "+-") - 2 * files


def upstream_tests(root: Path, paths: list[str]) -> list[str]:
    """The upstream-layout tests among ``paths`` that ``root`` holds."""
    return [
        p
        for p in paths
        if re.fullmatch(r"test/registered/.+/test_\w+\.py", p) and (root / p).is_file()
    ]


def run_tests(root: Path, tests: list[str]) -> subprocess.CompletedProcess:
    modules = [p[len("test/") : -len(".py")].replace("/", ".") for p in tests]
    return subprocess.run(
        [sys.executable, "-m", "unittest", *modules],
        cwd=root / "test",
        env={**os.environ, "PYTHONPATH": f"{root / 'python'}{os.pathsep}{HARNESS}"},
        capture_output=True,
        text=True,
        timeout=TESTS_TIMEOUT_S,
    )


def passed(done: subprocess.CompletedProcess) -> bool:
    """Exit 0, and more tests ran than were skipped."""
    ran = re.search(r"^Ran (\d+) tests?", done.stderr, flags=re.M)
    skipped = re.search(r"skipped=(\d+)", done.stderr)
    skips = int(skipped.group(1)) if skipped else 0
    return done.returncode == 0 and ran is not None and int(ran.group(1)) > skips


def same_tree(a: Path, b: Path) -> list[str]:
    """Paths that differ between two trees, manifest and bytecode left out."""
    found = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        found.extend(
            f"{rel}{n}" for n in cmp.left_only + cmp.right_only if n not in SKIP
        )
        found.extend(f"{rel}{n}" for n in cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{rel}{name}/")

    walk(filecmp.dircmp(a, b, ignore=list(SKIP)), "")
    return found


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("checkout")
    (where / "test" / "registered").mkdir(parents=True)
    (where / "python").mkdir()
    return copy_tree(PRISTINE, where / "python" / "sglang") and where


@pytest.fixture(scope="module")
def series(checkout, tmp_path_factory):
    out = tmp_path_factory.mktemp("series") / "out"
    done = run(sys.executable, OVERLAY, "--series", out, checkout)
    assert done.returncode == 0, done.stderr
    assert not (checkout / "python" / "sglang" / overlay.MANIFEST_NAME).exists()
    assert not any((checkout / "test" / "registered").iterdir())
    return out, (out / "series").read_text().split(), done.stdout


def test_the_series_is_the_fixes_as_stored_then_the_refactor_then_the_tools(series):
    out, names, printed = series
    parts = [(name, subject) for name, subject, _ in overlay_series.PARTS]
    expected = [(name, title) for name, title, _ in FIXES] + parts
    assert names == [f"{i:04d}-{n}.patch" for i, (n, _) in enumerate(expected, 1)]
    total = 0
    for index, (name, (_, subject), line) in enumerate(
        zip(names, expected, printed.splitlines()), 1
    ):
        head, _, diff = (out / name).read_text().partition("\n---\n")
        assert head == f"Subject: [PATCH {index}/{len(names)}] {subject}"
        if index <= len(FIXES):
            assert diff == FIXES[index - 1][2].read_text()
        total += changed(diff)
        assert re.match(rf"{name} +{changed(diff)} lines +{total} in all ", line)
    tools = touched(out / names[-1])
    assert tools and all(p.startswith(TOOLS) for p in tools)
    assert not any(p.startswith(TOOLS) for n in names[:-1] for p in touched(out / n))


@pytest.mark.parametrize("fix", FIXES, ids=[name for name, _, _ in FIXES])
def test_each_fix_applies_alone_and_its_tests_fail_without_it_and_pass_with_it(
    fix, checkout, tmp_path
):
    _, _, patch = fix
    assert changed(patch.read_text()) <= MAX_FIX_LINES
    done = run("git", "apply", "-p1", "--check", patch, cwd=checkout)
    assert done.returncode == 0, done.stderr
    tree = copy_tree(checkout, tmp_path / "tree", "-l")
    assert (
        run("git", "apply", "-p1", "--include=test/*", patch, cwd=tree).returncode == 0
    )
    tests = upstream_tests(tree, touched(patch))
    assert tests, f"{patch} carries no test/registered/**/test_*.py"
    before = run_tests(tree, tests)
    assert before.returncode != 0 and "FAILED" in before.stderr, before.stderr[-4000:]
    assert (
        run("git", "apply", "-p1", "--exclude=test/*", patch, cwd=tree).returncode == 0
    )
    after = run_tests(tree, tests)
    assert passed(after), after.stderr[-4000:]
    for linter in LINTERS:  # where upstream's own file passes it
        lint = (sys.executable, "-m", *linter)
        held = [
            tree / p
            for p in touched(patch)
            if p.endswith(".py")
            and not ((checkout / p).exists() and run(*lint, checkout / p).returncode)
        ]
        done = run(*lint, *held)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_series_applies_in_order_with_each_patchs_tests_and_ends_as_the_overlay(
    checkout, series, tmp_path
):
    out, names, _ = series
    applied = copy_tree(checkout, tmp_path / "applied", "-l")
    made = copy_tree(checkout, tmp_path / "made", "-l")
    assert run(sys.executable, OVERLAY, made).returncode == 0
    for name in names:
        done = run("git", "apply", "-p1", out / name, cwd=applied)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        paths = touched(out / name)
        tests = upstream_tests(applied, paths)
        if any(p.startswith("python/") for p in paths):
            assert tests, f"{name} changes python/ and adds or changes no test"
        if tests:
            done = run_tests(applied, tests)
            assert passed(done), f"{name}: {done.stderr[-4000:]}"
    assert same_tree(applied / "python", made / "python") == []
    assert same_tree(applied / "test", made / "test") == []


def test_the_tool_that_writes_the_series_is_at_most_300_lines():
    lines = len((REPO / "scripts" / "overlay_series.py").read_text().splitlines())
    branch = option = 0  # what overlay.py adds for it
    for node in ast.walk(ast.parse(OVERLAY.read_text())):
        if (
            isinstance(node, ast.If)
            and ast.unparse(node.test) == "args.series is not None"
        ):
            branch = node.body[-1].end_lineno - node.lineno + 1
        elif isinstance(node, ast.Call) and any(
            isinstance(a, ast.Constant) and a.value == "--series" for a in node.args
        ):
            option = node.end_lineno - node.lineno + 1
    assert branch and option
    assert lines + branch + option <= MAX_TOOL_LINES


def test_series_refuses_a_package_dir_an_overlaid_checkout_and_a_non_empty_out(
    checkout, tmp_path
):
    done = run(sys.executable, OVERLAY, "--series", tmp_path / "out", PRISTINE)
    assert done.returncode == 2 and "needs an sglang checkout" in done.stderr
    overlaid = copy_tree(checkout, tmp_path / "overlaid", "-l")
    assert run(sys.executable, OVERLAY, overlaid).returncode == 0
    done = run(sys.executable, OVERLAY, "--series", tmp_path / "out", overlaid)
    assert done.returncode == 2 and "needs a pristine sglang package" in done.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    done = run(sys.executable, OVERLAY, "--series", busy, checkout)
    assert done.returncode == 1 and "is not empty" in done.stderr
    assert not (tmp_path / "out").exists()


def test_series_refuses_a_checkout_a_fix_does_not_apply_to(checkout, tmp_path):
    tested = copy_tree(checkout, tmp_path / "tested", "-l")
    _, _, patch = FIXES[0]
    done = run("git", "apply", "-p1", "--include=test/*", patch, cwd=tested)
    assert done.returncode == 0
    done = run(sys.executable, OVERLAY, "--series", tmp_path / "out", tested)
    assert done.returncode == 2 and f"git apply {patch}" in done.stderr
    assert not (tmp_path / "out").exists()
