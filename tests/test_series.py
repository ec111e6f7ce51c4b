"""overlay.py --series: the change as patches a reviewer takes one at a time, onto a pristine sglang 0.5.23.

The checkout form is built on a checkout made from the pristine package: its
``python/sglang`` and a ``test/`` holding an empty ``registered/``. Upstream's
own ``test/`` tree is not part of the package, so this checkout lacks it: here
every ported test is a new file, where a real checkout's series replaces
upstream's ``test/registered/utils/test_numa_utils.py`` and friends. Each patch
is applied with ``git apply -p1`` at the checkout's root; after each one that
changes ``python/``, the upstream-layout tests it carries run with ``unittest``
against the patched tree, as upstream's CPU suite would run them, and every
intermediate state a patch leaves passes black and isort. The last patch leaves
exactly what ``overlay.py CHECKOUT`` makes. The package form (no tests in the
patches) ends as ``overlay.py PACKAGE`` does.
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
import re
import shutil
import subprocess
import sys
import textwrap
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
PATCH_TESTS_TIMEOUT_S = 240
SKIP = {"__pycache__", ".placement-overlay.json"}
LINTERS = (  # as scripts/lint.sh runs them
    (sys.executable, "-m", "black", "--check"),
    (
        sys.executable,
        "-m",
        "isort",
        "--check-only",
        "--profile",
        "black",
        "-p",
        "sglang",
    ),
)


def copy_tree(source: Path, dest: Path) -> Path:
    """A copy of ``source`` (cp: several times faster than shutil on sglang's 10,000 files)."""
    subprocess.run(["cp", "-R", str(source), str(dest)], check=True)
    return dest


def make_checkout(where: Path) -> Path:
    (where / "test" / "registered").mkdir(parents=True)
    (where / "python").mkdir()
    copy_tree(PRISTINE, where / "python" / "sglang")
    return where


def touched(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), flags=re.M)


def same_tree(a: Path, b: Path) -> list[str]:
    """Paths that differ between two trees, manifest and bytecode left out."""
    found = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        found.extend(
            f"{rel}{n}" for n in cmp.left_only + cmp.right_only if n not in SKIP
        )
        found.extend(f"{rel}{n}" for n in cmp.diff_files)
        for name, sub in cmp.subdirs.items():
            if name not in SKIP:
                walk(sub, f"{rel}{name}/")

    walk(filecmp.dircmp(a, b, ignore=list(SKIP)), "")
    return found


def run(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs
    )


def build(target: Path, **kwargs) -> list:
    """The series for ``target`` (a checkout or a package), built in-process."""
    found = overlay.find_target(target)
    changes, manifest = overlay.plan(found.pkg, REPO / "python" / "sglang", None)
    if found.tests is not None:
        changes = [dataclasses.replace(c, area=found.pkg_label) for c in changes]
    tests = found.tests or found.pkg / ".no-test-dir"
    changes += overlay.plan_tests(tests, REPO / "tests" / "upstream", manifest)[0]
    return overlay_series.build(
        changes,
        with_tests=found.tests is not None,
        change_type=overlay.Change,
        unified_diff=overlay.unified_diff,
        refuse=overlay.Refusal,
        **kwargs,
    )


def write_series(out: Path, target: Path) -> tuple[list[str], list, str]:
    # The size bounds are checked on their own below.
    built = build(target, max_lines=None)
    summary = "\n".join(overlay_series.write(out, built))
    return out.joinpath("series").read_text().split(), built, summary


@pytest.fixture(scope="module")
def checkout_series(tmp_path_factory):
    pristine = make_checkout(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("series") / "out"
    names, built, summary = write_series(out, pristine)
    assert not (pristine / "python" / "sglang" / overlay.MANIFEST_NAME).exists()
    assert not any((pristine / "test" / "registered").iterdir())
    return pristine, out, names, built, summary


def test_each_patch_has_a_header_an_operator_notice_and_its_tests(checkout_series):
    _, out, names, built, summary = checkout_series
    assert names == sorted(p.name for p in out.glob("*.patch"))
    assert [n[:4] for n in names] == [f"{i:04d}" for i in range(1, len(names) + 1)]
    assert names[-3:] == [
        f"{len(names) - 2:04d}-tools-plan.patch",
        f"{len(names) - 1:04d}-tools-capture-read-back.patch",
        f"{len(names):04d}-tools-verify.patch",
    ]
    for name, line, (_, _, lines) in zip(names, summary.splitlines(), built):
        head, _, diff = (out / name).read_text().partition("\n---\n")
        assert head.startswith(f"Subject: [PATCH {int(name[:4])}/{len(names)}] ")
        notice = re.search(r"^Operators notice: (.*)$", head, flags=re.M).group(1)
        assert notice.strip() and "nothing yet" not in notice.lower(), name
        tests = re.search(r"^Tests: (.*)$", head, flags=re.M).group(1).split(", ")
        assert {p for p in touched(out / name) if p.startswith("test/")} == set(tests)
        changed = [
            line
            for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
        ]
        assert len(changed) == lines > 0, name
        assert name in line and f"{lines} lines" in line
    fixes = summary.splitlines()[len(names) :]
    assert len(fixes) == len(overlay_series.BUGS), summary


def test_every_patch_changes_at_most_800_lines(checkout_series):
    _, _, names, built, _ = checkout_series
    over = {n: lines for n, (_, _, lines) in zip(names, built) if lines > 800}
    assert over == {}


def test_both_known_bugs_are_fixed_within_the_first_1500_changed_lines(
    checkout_series,
):
    _, _, _, built, _ = checkout_series
    fixed = overlay_series.fixed_at(built)
    assert set(fixed) == set(overlay_series.BUGS)
    assert fixed["shm"][0] == 1  # patch 1 fixes what an operator notices
    late = {bug: lines for bug, (_, lines) in fixed.items() if lines > 1500}
    assert late == {}


def test_the_cli_writes_the_series_in_patches_of_at_most_800_lines(tmp_path):
    done = run(sys.executable, OVERLAY, "--series", tmp_path / "out", PRISTINE)
    assert done.returncode == 0, done.stderr
    names = (tmp_path / "out" / "series").read_text().split()
    lines = [
        int(re.search(r" (\d+) lines ", line)[1])
        for line in done.stdout.splitlines()[: len(names)]
    ]
    assert len(names) == len(overlay_series.SERIES) and max(lines) <= 800


def test_each_patch_applies_and_its_own_tests_pass_right_after_it(
    checkout_series, tmp_path
):
    pristine, out, names, _, _ = checkout_series
    applied = copy_tree(pristine, tmp_path / "applied")
    made = copy_tree(pristine, tmp_path / "made")
    done = run(sys.executable, OVERLAY, made)
    assert done.returncode == 0, done.stderr
    states = tmp_path / "states"
    env = {**os.environ, "PYTHONPATH": f"{applied / 'python'}{os.pathsep}{HARNESS}"}
    for name in names:
        done = run("git", "apply", "-p1", out / name, cwd=applied)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        paths = touched(out / name)
        for path in paths:  # intermediate states, for the linters below
            if path.endswith(".py") and not filecmp.cmp(applied / path, made / path):
                (states / name[:4] / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(applied / path, states / name[:4] / path)
        if not any(p.startswith("python/") for p in paths):
            continue
        modules = [
            p.removeprefix("test/").removesuffix(".py").replace("/", ".")
            for p in paths
            if p.startswith("test/")
        ]
        assert modules, f"{name} changes python/ and carries no test"
        tests = subprocess.run(
            [sys.executable, "-m", "unittest", *modules],
            cwd=applied / "test",
            env=env,
            capture_output=True,
            text=True,
            timeout=PATCH_TESTS_TIMEOUT_S,
        )
        ran = re.search(r"^Ran (\d+) tests?", tests.stderr, flags=re.M)
        skipped = re.search(r"skipped=(\d+)", tests.stderr)
        assert tests.returncode == 0 and ran, f"{name}: {tests.stderr[-4000:]}"
        assert int(ran.group(1)) > int(skipped.group(1) if skipped else 0), name
    assert same_tree(applied / "python", made / "python") == []
    assert same_tree(applied / "test", made / "test") == []
    for linter in LINTERS:
        held = [s for s in states.rglob("*.py") if held_to(linter, s, pristine, states)]
        if held:
            done = run(*linter, *held)
            assert done.returncode == 0, done.stdout + done.stderr


def held_to(linter: tuple[str, ...], state: Path, pristine: Path, states: Path) -> bool:
    """As scripts/lint.sh: a state of an upstream file is held to a linter only where
    upstream's own file passes it (upstream's findings are upstream's)."""
    upstream = pristine.joinpath(*state.relative_to(states).parts[1:])
    return not upstream.exists() or run(*linter, upstream).returncode == 0


def test_the_package_form_has_no_tests_and_ends_as_the_overlay(tmp_path):
    names, _, _ = write_series(tmp_path / "out", PRISTINE)
    assert not (PRISTINE / overlay.MANIFEST_NAME).exists()
    applied = tmp_path / "applied"
    applied.mkdir()
    copy_tree(PRISTINE, applied / "sglang")
    made = copy_tree(PRISTINE, tmp_path / "made")
    for name in names:
        assert all(p.startswith("sglang/") for p in touched(tmp_path / "out" / name))
        done = run("git", "apply", "-p1", tmp_path / "out" / name, cwd=applied)
        assert done.returncode == 0, f"{name}: {done.stderr}"
    done = run(sys.executable, OVERLAY, made)
    assert done.returncode == 0, done.stderr
    assert same_tree(applied / "sglang", made) == []


def test_series_refuses_a_package_that_holds_an_overlay_and_a_non_empty_out(tmp_path):
    checkout = make_checkout(tmp_path / "checkout")
    assert run(sys.executable, OVERLAY, checkout).returncode == 0
    done = run(sys.executable, OVERLAY, "--series", tmp_path / "out", checkout)
    assert done.returncode == 2 and "needs a pristine sglang package" in done.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    done = run(sys.executable, OVERLAY, "--series", busy, PRISTINE)
    assert done.returncode == 1 and "is not empty" in done.stderr


# --------------------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def changes():
    found, manifest = overlay.plan(PRISTINE, REPO / "python" / "sglang", None)
    tests = PRISTINE / ".no-test-dir"
    return found + overlay.plan_tests(tests, REPO / "tests" / "upstream", manifest)[0]


def refusal(changes, series, max_lines=None) -> str:
    with pytest.raises(overlay.Refusal) as refused:
        overlay_series.build(
            changes,
            with_tests=False,
            change_type=overlay.Change,
            unified_diff=overlay.unified_diff,
            refuse=overlay.Refusal,
            series=series,
            max_lines=max_lines,
        )
    return str(refused.value)


def with_patch(index: int, **changed) -> list:
    series = list(overlay_series.SERIES)
    series[index] = dataclasses.replace(series[index], **changed)
    return series


def test_a_patch_that_changes_python_without_a_test_is_refused(changes):
    first = overlay_series.SERIES[0]
    code = tuple(p for p in first.files if not p.startswith("test/"))
    assert "patch 1 (shm-segments) changes python/ but adds no test" in refusal(
        changes, with_patch(0, files=code)
    )


@pytest.mark.parametrize("notice", ["Nothing yet.", "Nothing yet: no caller", "  "])
def test_a_patch_whose_operators_notice_nothing_is_refused(changes, notice):
    assert "patch 2 (ray-actors): its Operators notice says nothing" in refusal(
        changes, with_patch(1, operators=notice)
    )


def test_a_patch_over_800_lines_is_refused(changes):
    first, *rest = overlay_series.SERIES
    ray = next(p for p in rest if p.fixes == "ray")
    merged = dataclasses.replace(first, files=first.files + ray.files)
    found = refusal(changes, [merged, *(p for p in rest if p != ray)], max_lines=800)
    assert re.search(
        r"patch 1 \(shm-segments\) changes \d+ lines, more than 800", found
    )
    assert re.search(r"sglang/srt/distributed/shm_collective\.py \d+", found)


def test_a_file_in_two_patches_or_in_none_is_refused(changes):
    first, second = overlay_series.SERIES[:2]
    twice = with_patch(1, files=second.files + first.files[-1:])
    assert f"{first.files[-1]} is in patches patch 1" in refusal(changes, twice)
    left = with_patch(0, files=first.files[1:])
    assert f"no patch of the series holds {first.files[0]}" in refusal(changes, left)
    again = overlay_series.Partial(first.files[1], keep=())
    back = with_patch(1, partial=(again,))
    assert f"{first.files[1]} is in patches patch 1" in refusal(changes, back)


def test_a_partial_naming_what_the_final_file_lacks_is_refused(changes):
    partial = overlay_series.Partial(overlay_series.P + "topology.py", keep=("nope",))
    topology = with_patch(
        1, files=overlay_series.SERIES[1].files[1:], partial=(partial,)
    )
    found = refusal(changes, topology)
    assert "patch 2 (ray-actors) names nope, which the final" in found


# --------------------------------------------------------------------------- new files in steps

FINAL = '''\
"""A module that grows patch by patch."""

import os

from sglang.srt.placement import cpulist
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist

LIMIT = 4
FIRST, SECOND = "a", "b"


def early():
    return LIMIT, format_cpulist


# The comment goes with its definition.
def late():
    return cpulist, parse_cpulist


class Later:
    pass


TABLE = {"early": early}
os.getpid()

if __name__ == "__main__":
    early()
'''


def test_a_new_file_keeps_what_the_named_definitions_use_spaced_as_black_does(
    tmp_path,
):
    state = overlay_series.sliced(FINAL, ("SECOND", "TABLE"))
    assert state == textwrap.dedent(
        '''\
        """A module that grows patch by patch."""

        import os

        from sglang.srt.placement.cpulist import format_cpulist

        LIMIT = 4
        FIRST, SECOND = "a", "b"


        def early():
            return LIMIT, format_cpulist


        TABLE = {"early": early}
        os.getpid()

        if __name__ == "__main__":
            early()
        '''
    )
    assert overlay_series.sliced(FINAL, ("late", "Later", "FIRST", "TABLE")) == FINAL
    assert overlay_series.imports_of(state) == (
        ("sglang.srt.placement.cpulist", "format_cpulist", frozenset()),
    )
    (tmp_path / "state.py").write_text(state)
    for linter in LINTERS:
        done = run(*linter, tmp_path / "state.py")
        assert done.returncode == 0, done.stdout + done.stderr


def test_an_import_of_a_name_the_final_module_lacks_is_refused(changes):
    partial = overlay_series.Partial(
        overlay_series.PT + "test_topology.py", keep=("TestReadTopology",)
    )
    series = with_patch(0, partial=(partial,))
    topology = next(c for c in changes if c.rel == "srt/placement/topology.py")
    gone = dataclasses.replace(
        topology, new=topology.new.replace(b"def read_topology(", b"def gone(")
    )
    found = refusal([gone if c is topology else c for c in changes], series)
    assert (
        "patch 1 (shm-segments): test/registered/placement/test_topology.py imports "
        "read_topology from python/sglang/srt/placement/topology.py, which its final "
        "content does not define"
    ) in found


def test_a_span_swap_replaces_the_block_between_its_ends_or_is_refused():
    text = "a\nfirst\nmiddle\nlast\nz\nlast\n"
    span = overlay_series.Span("first\n", "last\n")
    done = overlay_series.swapped(text, [(span, "new\n")], overlay.Refusal, "p")
    assert done == "a\nnew\nz\nlast\n"  # through the first end after the start
    with pytest.raises(overlay.Refusal, match="end is not after its start"):
        overlay_series.swapped(
            text, [(overlay_series.Span("z\n", "first"), "")], overlay.Refusal, "p"
        )
    with pytest.raises(overlay.Refusal, match="found 2 times"):
        overlay_series.swapped(text, [("last\n", "")], overlay.Refusal, "p")
