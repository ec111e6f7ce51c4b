"""The pull requests of upstream_prs/, as a reviewer takes them: one at a time on
pristine sglang 0.5.23, each small, described, clean under upstream's linters, adding no
module nothing imports, its tests failing on the tree before it and passing right after
it, and the whole stack ending where scripts/overlay.py does.

A pull request's tests are the test files it adds under ``test/registered/``, and the
test classes it adds to upstream's ``test/registered/utils/test_numa_utils.py``. That
file is not in the wheel: without an upstream source tree (``SGLANG_UPSTREAM_SOURCE``),
the added classes run on their own, after the names upstream's header imports; with
one, the file runs whole, and every test of upstream's that passes on pristine 0.5.23
must pass at the end of the stack. The kernel's pull requests and their caller's tests
need a built kernel: tests/test_shm_kernel.py runs them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import overlay  # noqa: E402
import stack  # noqa: E402

HARNESS = REPO / "tests" / "harness"
LINT = Path(sys.executable).parent
NUMA_TESTS = "test/registered/utils/test_numa_utils.py"
# What upstream's test_numa_utils.py imports, for its added classes run on their own.
NUMA_TESTS_HEADER = """\
import ctypes, os, shutil, stat, subprocess, sys, tempfile, threading, time, unittest
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

from sglang.srt.environ import envs
import sglang.srt.utils.numa_utils as _numa_utils

globals().update(
    {k: getattr(_numa_utils, k) for k in dir(_numa_utils) if not k.startswith("__")}
)
"""
UPSTREAM = os.environ.get("SGLANG_UPSTREAM_SOURCE")
PRS = stack.pull_requests()
KERNEL = "python/sglang/kernels/aot/"
KERNEL_MAX_LINES = 400


def _kernel_pr(pr: stack.PullRequest) -> bool:
    """A kernel pull request, or one whose tests load the built kernel."""
    text = pr.patch.read_text()
    return f" a/{KERNEL}" in text or re.search(r"^\+\s*import sgl_kernel", text, re.M)


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> Path:
    """A checkout with one commit per pull request (the first: pristine)."""
    root = tmp_path_factory.mktemp("stack") / "checkout"
    upstream = Path(UPSTREAM) if UPSTREAM else None
    stack.make_checkout(root, upstream=upstream)
    for pr in PRS:
        stack.apply(pr, root, commit=True)
    return root


def _stage(applied: Path, index: int, dest: Path) -> Path:
    """The checkout as it is after the first ``index`` pull requests, in ``dest``."""
    commit = stack.git("rev-list", "--reverse", "HEAD", cwd=applied).split()[index]
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit], cwd=applied, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def _package(index: int, dest: Path) -> Path:
    """``dest/python``, holding the package after the first ``index`` pull requests:
    hard links to the pristine one, whose bytecode stays valid for the files no patch
    changes (git apply replaces a file, never writes through a link)."""
    package = dest / "python" / "sglang"
    package.parent.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(stack.PRISTINE), str(package)], check=True)
    for patch in overlay.patches()[:index]:
        assert overlay.apply_patch(package, patch) is None
    return package.parent


def _added(patch: str, path: str) -> list[tuple[int, str]]:
    """(line in the new file, text) of each line ``patch`` adds to ``path``."""
    found, line, inside = [], 0, False
    for text in patch.splitlines():
        if text.startswith("diff --git "):
            inside = text.endswith(f" b/{path}")
        elif inside and text.startswith("@@"):
            line = int(re.match(r"@@ -\S+ \+(\d+)", text)[1])
        elif inside and text.startswith("+") and not text.startswith("+++"):
            found.append((line, text[1:]))
            line += 1
        elif inside and not text.startswith("-") and not text.startswith("\\"):
            line += 1
    return found


def _added_numa_tests(pr: stack.PullRequest) -> str:
    """The test classes ``pr`` adds to upstream's test_numa_utils.py, runnable alone."""
    blocks, block, last = [], [], None
    for line, text in _added(pr.patch.read_text(), NUMA_TESTS):
        if last is not None and line != last + 1:
            blocks.append(block)
            block = []
        block.append(text)
        last = line
    blocks.append(block)
    whole = []
    for block in blocks:
        code = "\n".join(block) + "\n"
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue  # lines inside upstream's code: run with the whole file only
        if any(isinstance(node, (ast.ClassDef, ast.FunctionDef)) for node in tree.body):
            whole.append(code)
    return NUMA_TESTS_HEADER + "\n\n" + "\n\n".join(whole) if whole else ""


def _pr_tests(pr: stack.PullRequest, root: Path) -> list[Path]:
    """The test files of ``pr`` written under ``root``, ready to run."""
    files = []
    for path, new in pr.paths():
        if not path.startswith("test/registered/") or not path.endswith(".py"):
            continue
        if new:
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("\n".join(t for _, t in _added(pr.patch.read_text(), path)) + "\n")
            files.append(target)
        elif path == NUMA_TESTS:
            code = _added_numa_tests(pr)
            if code:
                target = root / "added" / f"test_numa_utils_{pr.name[:4]}.py"
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(code)
                files.append(target)
    return files


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[int, tuple[dict[str, str], str]]:
    """For each tree a pull request's tests run on (the one before it, the one right
    after it, and the last), ({pull request: "passed" or "failed"}, pytest's output),
    from one pytest run per tree."""
    root = tmp_path_factory.mktemp("outcomes")
    owner, wanted = {}, {}
    for index, pr in enumerate(PRS):
        if _kernel_pr(pr):
            continue
        files = _pr_tests(pr, root / pr.name)
        assert files, f"{pr.name} adds no test"
        for f in files:
            owner[str(f.relative_to(root))] = pr.name
        for stage in (index, index + 1, len(PRS)):
            wanted.setdefault(stage, {}).update(dict.fromkeys(files))

    def run(stage: int) -> tuple[dict[str, str], str]:
        env = dict(os.environ)
        python = _package(stage, root / f"stage{stage}")
        env["PYTHONPATH"] = os.pathsep.join([str(python), str(HARNESS)])
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
             "--continue-on-collection-errors", f"--rootdir={root}",
             *map(str, wanted[stage])],
            cwd=root, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        result = {}
        for kind, path in re.findall(
            r"^(PASSED|FAILED|ERROR) (\S+?\.py)\b", done.stdout, re.M
        ):
            name = owner[path]
            bad = kind != "PASSED" or result.get(name) == "failed"
            result[name] = "failed" if bad else "passed"
        return result, done.stdout[-4000:]

    # Mostly imports, one core each: two trees at a time.
    with ThreadPoolExecutor(2) as pool:
        found = dict(zip(wanted, pool.map(run, wanted)))
    return found


def test_each_pull_request_is_small_and_described():
    assert PRS, "upstream_prs/ holds no pull request"
    for pr in PRS:
        added, removed = pr.lines()
        # sgl-kernel's group set-up is one new file that cannot be tested in halves.
        limit = KERNEL_MAX_LINES if f" a/{KERNEL}" in pr.patch.read_text() else None
        limit = limit or stack.MAX_LINES
        assert added + removed <= limit, f"{pr.name}: {added + removed} lines"
        assert pr.description.is_file(), f"{pr.name}: no DESCRIPTION.md"
        assert pr.title.startswith("["), f"{pr.name}: title {pr.title!r}"


def test_the_stack_ends_where_the_overlay_does(applied, tmp_path):
    package = tmp_path / "sglang"
    subprocess.run(["cp", "-al", str(stack.PRISTINE), str(package)], check=True)
    assert overlay.overlay(package) is None
    diff = subprocess.run(
        ["diff", "-r", "-q", "-x", "__pycache__", "-x", "placement_tools",
         str(applied / "python" / "sglang"), str(package)],
        capture_output=True, text=True,
    )  # fmt: skip
    # the kernel's sources (KERNEL) build sgl-kernel: the overlay leaves them out
    kernel = f"Only in {applied / 'python' / 'sglang' / 'kernels'}: aot"
    differences = [d for d in diff.stdout.splitlines() if d != kernel]
    assert not differences, "\n".join(differences)[-3000:]


def test_no_pull_request_adds_a_module_nothing_imports(applied, tmp_path):
    for index, pr in enumerate(PRS, start=1):
        new = [
            p
            for p, is_new in pr.paths()
            if is_new and p.startswith("python/sglang/") and p.endswith(".py")
        ]
        if not new:
            continue
        stage = _stage(applied, index, tmp_path / pr.name)
        code = "".join(
            f.read_text()
            for f in (stage / "python").rglob("*.py")
            if str(f.relative_to(stage)) not in new
        )
        for path in new:
            module = path[len("python/") : -len(".py")].replace("/", ".")
            assert module in code, f"{pr.name}: nothing imports {module}"


def _lint(files: dict[Path, set[int]]) -> list[str]:
    """Upstream's linters' findings on the given lines of each file (a pull request's
    own lines: upstream's own findings are upstream's); one run of each linter."""
    names = [str(f) for f in files]
    black = subprocess.run(
        [str(LINT / "black"), "-q", "--diff", *names], capture_output=True, text=True
    )
    findings = []
    for block in re.split(r"^--- ", black.stdout, flags=re.M)[1:]:
        path = Path(block.split("\t", 1)[0].strip())
        for hunk in re.finditer(r"^@@ -(\d+)(?:,(\d+))? ", block, re.M):
            start, length = int(hunk[1]), int(hunk[2] or 1)
            if files[path] & set(range(start, start + length)):
                findings.append(f"black reformats {path}:{start}")
    isort = subprocess.run(
        [str(LINT / "isort"), "--check-only", "--profile", "black", "-p", "sglang",
         *names],
        capture_output=True, text=True,
    )  # fmt: skip
    findings += re.findall(r"^ERROR: .*$", isort.stderr + isort.stdout, re.M)
    ruff = subprocess.run(
        [str(LINT / "ruff"), "check", "--isolated", "--no-cache",
         "--select=F401,F821,UP037", "--output-format=json", *names],
        capture_output=True, text=True,
    )  # fmt: skip
    for item in json.loads(ruff.stdout or "[]"):
        if item["location"]["row"] in files[Path(item["filename"])]:
            findings.append(f"ruff {item['code']} {item['filename']}")
    spell = subprocess.run(
        [str(LINT / "codespell"), "-L", "cann,thi,makro,wil,rouge,PRIS,renderD",
         *names],
        capture_output=True, text=True,
    )  # fmt: skip
    for row in spell.stdout.splitlines():
        path, line = row.split(":")[:2]
        if int(line) in files[Path(path)]:
            findings.append(f"codespell {row}")
    return findings


def test_each_pull_request_passes_upstreams_linters(applied, tmp_path):
    """Each Python file a pull request touches, as it is right after it."""
    commits = stack.git("rev-list", "--reverse", "HEAD", cwd=applied).split()
    files = {}
    for index, pr in enumerate(PRS, start=1):
        patch = pr.patch.read_text()
        for path, _ in pr.paths():
            mine = {line for line, _ in _added(patch, path)}
            if not path.endswith(".py") or not mine:
                continue
            shown = subprocess.run(
                ["git", "show", f"{commits[index]}:{path}"],
                cwd=applied, capture_output=True, text=True,
            )  # fmt: skip
            if shown.returncode != 0:  # upstream's file, not in the wheel
                continue
            target = tmp_path / pr.name / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(shown.stdout)
            files[target] = mine
    assert files
    findings = _lint(files)
    assert not findings, "\n".join(findings)


@pytest.mark.parametrize("index", range(len(PRS)), ids=[pr.name for pr in PRS])
def test_a_pull_requests_tests_fail_before_it_and_pass_after(outcomes, index):
    pr = PRS[index]
    if _kernel_pr(pr):
        pytest.skip(f"{pr.name}: its tests need the built kernel (tests/test_shm_kernel.py)")
    after, output = outcomes[index + 1]
    assert after.get(pr.name) == "passed", f"{pr.name} after: {output}"
    before, output = outcomes[index]
    assert before.get(pr.name) == "failed", f"{pr.name} before: {output}"


def test_every_pull_requests_tests_pass_on_the_last_tree(outcomes):
    result, output = outcomes[len(PRS)]
    expected = {pr.name: "passed" for pr in PRS if not _kernel_pr(pr)}
    assert result == expected, output


@pytest.mark.skipif(not UPSTREAM, reason="set SGLANG_UPSTREAM_SOURCE to an sglang source tree")
def test_upstreams_numa_utils_tests_that_pass_on_pristine_pass_at_the_end(applied, tmp_path):
    pristine = _stage(applied, 0, tmp_path / "pristine")
    end = _stage(applied, len(PRS), tmp_path / "end")

    def outcomes(root: Path) -> dict[str, set[str]]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root / "python"), str(HARNESS)])
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
             NUMA_TESTS],
            cwd=root, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        found = re.findall(r"^(PASSED|FAILED|ERROR) \S+?::(\S+)", done.stdout, re.M)
        return {kind: {name for k, name in found if k == kind} for kind in ("PASSED", "FAILED")}

    before, after = outcomes(pristine), outcomes(end)
    assert len(before["PASSED"]) >= 37, before
    assert before["PASSED"] <= after["PASSED"], sorted(before["PASSED"] - after["PASSED"])
    assert after["FAILED"] < before["FAILED"], (before["FAILED"], after["FAILED"])
