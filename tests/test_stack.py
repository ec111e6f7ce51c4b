"""The upstream pull requests (upstream_prs/, scripts/stack.py) as a reviewer takes them.

On a pristine sglang 0.5.23 checkout (the wheel's package and an empty ``test/registered/``):
every pull request is at most 400 changed lines with a description in sglang's template; the
stack applies in order; the upstream-layout tests each one adds or changes fail on the tree
before it and pass right after it; later ones delete under 2% of what earlier ones added;
upstream's linters are clean on what each touches; and the last leaves what ``overlay.py
CHECKOUT`` makes, less the operator tools (which are not part of the stack).

A kernel pull request patches sgl-kernel's CPU sources, which the wheel does not ship: here it
is checked for size and form; ``scripts/build_cpu_kernel.py`` applies it to a source checkout.
With ``SGLANG_UPSTREAM_SOURCE`` naming an sglang source tree, the kernel's sources and upstream's
own tests of what the stack changes join the checkout: a kernel pull request's tests then run
after it on the kernel ``SGLANG_CPU_KERNEL`` names (built from the whole stack, so not before
it), and every test of upstream's ``test_numa_utils.py`` that passes on pristine 0.5.23 must
pass at the end. Without ``SGLANG_CPU_KERNEL``, tests that need the kernel skip with one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import stack  # noqa: E402

OVERLAY = REPO / "scripts" / "overlay.py"
HARNESS = REPO / "tests" / "harness"
UPSTREAM = os.environ.get("SGLANG_UPSTREAM_SOURCE")
TOOLS = ("python/sglang/srt/placement_tools", "test/registered/placement_tools")
KERNEL = "python/sglang/kernels/aot/"
SECTIONS = ("## Motivation", "## Modifications", "## Accuracy Tests", "## Checklist")
LINTERS = (  # upstream's pre-commit linters, as scripts/lint.sh runs them
    ("black", "--check"),
    ("isort", "--check-only", "--profile", "black", "-p", "sglang"),
    ("ruff", "check", "--no-cache", "--isolated", "--select=F401"),
    ("codespell_lib", "-L", "cann,thi,makro,wil,rouge,PRIS,renderD"),
)
PRS = stack.pull_requests()


def is_kernel(pr: stack.PullRequest) -> bool:
    return all(path.startswith(KERNEL) or path.startswith("test/registered/cpu/")
               for path, _ in pr.paths())  # fmt: skip


def run(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=600, **kwargs
    )


def upstream_tests(pr: stack.PullRequest, root: Path) -> list[str]:
    return [
        path
        for path, _ in pr.paths()
        if re.fullmatch(r"test/registered/.+/test_\w+\.py", path)
        and (root / path).is_file()
    ]


def run_tests(
    root: Path, tests: list[str], *options: str
) -> subprocess.CompletedProcess:
    """pytest (which, unlike ``unittest`` given module names, takes a module's
    ``SkipTest`` at import as a skip) on ``tests``, from the checkout's ``test/``."""
    paths = [p[len("test/") :] for p in tests]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "-W", "ignore", *options, *paths],
        cwd=root / "test",
        env={**os.environ, "PYTHONPATH": f"{root / 'python'}{os.pathsep}{HARNESS}"},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip


def passed(done: subprocess.CompletedProcess) -> bool:
    """Exit 0 and a test passed (but for the kernel's tests, which skip with one line
    where no CPU kernel is built)."""
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    kernel_only = "skipped" in summary and "SGLANG_CPU_KERNEL" in done.stdout
    if kernel_only:  # a module skipped at import: pytest collected no test (5)
        return done.returncode in (0, 5)
    return done.returncode == 0 and " passed" in f" {summary}"


def tree_files(root: Path, top: str) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in (root / top).rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.name != ".placement-overlay.json"
    }


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> Path:
    """The checkout with the whole stack applied, one git commit per pull request."""
    where = tmp_path_factory.mktemp("stack") / "checkout"
    upstream = Path(UPSTREAM) if UPSTREAM else None
    stack.make_checkout(where, upstream=upstream)
    for pr in PRS:
        stack.apply(pr, where, commit=True)
    return where


def test_every_pull_request_is_small_and_described():
    assert PRS, "upstream_prs/ holds no pull request"
    for pr in PRS:
        added, removed = pr.lines()
        assert added + removed <= stack.MAX_LINES, f"{pr.name}: {added + removed} lines"
        text = pr.description.read_text()
        assert text.startswith("# ") and all(s in text for s in SECTIONS), pr.name
        assert pr.paths(), f"{pr.name}: an empty patch"


def test_only_upstreams_own_files_are_ever_left_out(applied):
    """What the wheel lacks: sgl-kernel's sources and upstream's own tests."""
    for pr in PRS:
        for path in stack.excluded(pr, applied):
            assert path.startswith((KERNEL, "test/")), f"{pr.name}: {path}"


@pytest.mark.parametrize("index", range(len(PRS)), ids=[pr.name for pr in PRS])
def test_each_pull_requests_tests_fail_before_it_and_pass_after_it(
    index, applied, tmp_path
):
    pr = PRS[index]
    tree = tmp_path / "tree"
    commits = stack.git("rev-list", "--reverse", "HEAD", cwd=applied).split()
    stack.git("worktree", "add", "-q", "--detach", str(tree), commits[index],
              cwd=applied)  # fmt: skip
    try:
        if is_kernel(pr) and stack.excluded(pr, tree):
            pytest.skip(f"{pr.name} patches sgl-kernel's sources, not in the wheel")
        left_out = [f"--exclude={p}" for p in stack.excluded(pr, tree)]
        stack.git("apply", "-p1", "--include=test/*", *left_out, str(pr.patch),
                  cwd=tree)  # fmt: skip
        tests = upstream_tests(pr, tree)
        if any(p.startswith("python/") for p, _ in pr.paths()):
            assert tests, f"{pr.name} changes python/ and adds or changes no test"
        if not tests:
            return
        # A kernel PR's tests run on the kernel SGLANG_CPU_KERNEL names, built from the
        # whole stack: the tree before it is not the kernel they run on, so only after.
        before = None if is_kernel(pr) else run_tests(tree, tests)
        if before and not (passed(before) and "SGLANG_CPU_KERNEL" in before.stdout):
            assert before.returncode != 0, f"{pr.name}: passed before it"
        stack.git("apply", "-p1", "--exclude=test/*", *left_out, str(pr.patch),
                  cwd=tree)  # fmt: skip
        after = run_tests(tree, tests)
        assert passed(after), f"{pr.name}: {after.stdout[-4000:]}"
        for linter in LINTERS:  # where upstream's own file passes it
            lint = (sys.executable, "-m", *linter)
            held = [
                tree / path
                for path, _ in pr.paths()
                if path.endswith(".py")
                and (tree / path).is_file()
                and not (
                    (
                        pristine := stack.PRISTINE / path.removeprefix("python/sglang/")
                    ).is_file()
                    and run(*lint, pristine).returncode
                )
            ]
            done = run(*lint, *held) if held else None
            assert done is None or done.returncode == 0, done.stdout + done.stderr
    finally:
        stack.git("worktree", "remove", "--force", str(tree), cwd=applied)


def test_the_stack_ends_where_the_overlay_does(applied, tmp_path):
    made = tmp_path / "made"
    stack.make_checkout(made)
    assert run(sys.executable, OVERLAY, made).returncode == 0
    root = stack.git("rev-list", "--max-parents=0", "HEAD", cwd=applied).strip()
    upstreams = set(
        stack.git("ls-tree", "-r", "--name-only", root, cwd=applied).split()
    )
    for top in ("python", "test"):
        want = {
            k: v for k, v in tree_files(made, top).items() if not k.startswith(TOOLS)
        }
        got = tree_files(applied, top)
        ours = want.keys() | (got.keys() - upstreams)  # upstream's own files aside
        differ = sorted(k for k in ours if want.get(k) != got.get(k))
        assert differ == [], differ[:20]


def test_later_pull_requests_delete_under_2_percent_of_what_earlier_ones_added(
    applied,
):
    deleted = stack.later_deletions(applied)
    added = sum(pr.lines()[0] for pr in PRS)
    assert sum(deleted.values()) < 0.02 * added, deleted


@pytest.mark.skipif(
    not UPSTREAM, reason="set SGLANG_UPSTREAM_SOURCE to an sglang source tree"
)
def test_upstreams_own_numa_utils_tests_pass_at_the_end_of_the_stack(applied, tmp_path):
    """Every test of upstream's file that passes on pristine 0.5.23 passes at the end
    (the file itself is unchanged by the stack)."""
    test = "test/registered/utils/test_numa_utils.py"
    root = stack.git("rev-list", "--max-parents=0", "HEAD", cwd=applied).strip()
    assert stack.git("diff", "--stat", root, "HEAD", "--", test, cwd=applied) == ""
    stack.git("worktree", "add", "-q", "--detach", str(tmp_path / "pristine"), root,
              cwd=applied)  # fmt: skip
    try:
        before = run_tests(tmp_path / "pristine", [test], "-rA")
    finally:
        stack.git("worktree", "remove", "--force", str(tmp_path / "pristine"),
                  cwd=applied)  # fmt: skip
    after = run_tests(applied, [test], "-rA")
    passing = lambda done: set(re.findall(r"^PASSED (\S+)", done.stdout, flags=re.M))
    assert len(passing(before)) >= 30, before.stdout[-3000:]
    assert passing(before) <= passing(after), sorted(passing(before) - passing(after))
