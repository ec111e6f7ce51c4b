"""scripts/overlay.py on small fake repo trees and hard-link copies of the pristine sglang package."""

from __future__ import annotations

import ast
import difflib
import importlib.metadata
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import libcst  # noqa: F401  (the overlay needs it: a missing libcst must fail here, not skip)
import pytest
from conftest import full_import_env

OVERLAY = Path(__file__).resolve().parent.parent / "scripts" / "overlay.py"
BOOTSTRAP, ENGINE, ENVIRON = (
    "srt/distributed/bootstrap.py",
    "srt/ray/engine.py",
    "srt/environ.py",
)
NUMA = "srt/utils/numa_utils.py"
SCHEDULER = "srt/managers/scheduler.py"
SHM_IMPORT = (
    "from sglang.srt.distributed.shm_collective import finish_shm_collective, "
    "start_shm_collective"
)
SHM_NEW = ("start_shm_collective(dist_init_method=dist_init_method, tp_size=parallel.tp_size, "
           "tp_rank=parallel.tp_rank, pp_rank=parallel.pp_rank)")  # fmt: skip
SHM_KEEP = 'os.environ["LOCAL_SIZE"] = str(parallel.tp_size)'
SHM_OLD = (
    "_set_shm_master_env(dist_init_method)",
    "torch.ops.sgl_kernel.initialize(parallel.tp_size, parallel.tp_rank)",
)
ENV_FIELDS = {"SGLANG_CPU_OMP_THREADS_BIND": "EnvStr('all')"}
REPO_FILES = {
    "srt/placement/__init__.py": '"""Placement."""\n',
    "srt/placement/plan.py": "def plan():\n    return 1\n",
    "srt/distributed/shm_collective.py": "def start_shm_collective(**kwargs):\n    pass\n",
    NUMA: '"""Owned whole by the project."""\n',
}


def _top(tree: ast.Module, name: str) -> ast.AST:
    return next(n for n in tree.body if getattr(n, "name", None) == name)


def _has_upstream_actor_body(pkg: Path) -> bool:
    if not (pkg / ENGINE).is_file():
        return False
    fns = [
        n
        for n in ast.parse((pkg / ENGINE).read_text()).body
        if getattr(n, "name", "") == "_create_scheduler_actor"
    ]
    return any("SchedulerActor.options(" in ast.unparse(fn) for fn in fns)


@pytest.fixture(scope="session")
def pristine() -> Path:
    """The pristine sglang package dir: $SGLANG_PRISTINE_DIR/sglang, else the copy scripts/setup.sh keeps in
    .venv/pristine, else the installed one (not imported)."""
    if os.environ.get("SGLANG_PRISTINE_DIR"):
        candidates = [Path(os.environ["SGLANG_PRISTINE_DIR"]) / "sglang"]
    else:
        candidates = [OVERLAY.parent.parent / ".venv" / "pristine" / "sglang"]
        spec = importlib.util.find_spec("sglang")
        candidates += (
            [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        )
        try:
            candidates.append(
                Path(
                    str(importlib.metadata.distribution("sglang").locate_file("sglang"))
                )
            )
        except importlib.metadata.PackageNotFoundError:
            pass
    for pkg in candidates:
        if _has_upstream_actor_body(pkg):
            return pkg
    pytest.fail(
        f"no pristine sglang package among {[str(c) for c in candidates]} (one whose {ENGINE} still has "
        "upstream's _create_scheduler_actor body); set SGLANG_PRISTINE_DIR to the dir that holds it"
    )


@pytest.fixture(scope="session")
def link_source(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pristine`` itself when tmp is on its filesystem (hard links work), else one full copy of it."""
    probe = tmp_path_factory.mktemp("probe") / "version.py"
    try:
        os.link(pristine / "version.py", probe)
        return pristine
    except OSError:
        return Path(
            shutil.copytree(pristine, tmp_path_factory.mktemp("orig") / "sglang")
        )


@pytest.fixture
def pkg(link_source: Path, tmp_path: Path):
    """A `cp -al` copy of the pristine package; afterwards the pristine files must be unchanged."""
    before = {
        rel: (link_source / rel).read_bytes()
        for rel in (BOOTSTRAP, ENGINE, ENVIRON, NUMA)
    }
    dest = tmp_path / "site" / "sglang"
    shutil.copytree(
        link_source,
        dest,
        copy_function=os.link,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    yield dest
    assert {
        rel: (link_source / rel).read_bytes() for rel in before
    } == before, "the pristine package changed"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A fake repo python/ dir: new modules, a new package and an owned-whole numa_utils.py."""
    for rel, text in REPO_FILES.items():
        (tmp_path / "repo" / "python" / "sglang" / rel).parent.mkdir(
            parents=True, exist_ok=True
        )
        (tmp_path / "repo" / "python" / "sglang" / rel).write_text(text)
    return tmp_path / "repo" / "python"


def overlay(pkg: Path, repo: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(OVERLAY), str(pkg), "--repo-python", str(repo), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def snapshot(root: Path) -> Dict[str, Tuple[int, int, int, int]]:
    """Every path under root with inode, mtime, size and mode: any write changes one of them."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (
            st.st_ino,
            st.st_mtime_ns,
            st.st_size,
            st.st_mode,
        )
    return out


def edit(path: Path, old: str, new: str) -> None:
    """Change a hard-linked package file without touching the pristine copy it shares an inode with."""
    text = path.read_text()
    assert old in text
    path.unlink()
    path.write_text(text.replace(old, new, 1))


def assert_only_changed(old: str, new: str, spans: List[Tuple[int, int]]) -> None:
    """Every differing line of ``old`` (0-based, end exclusive) lies in one of ``spans``; each span changed."""
    matcher = difflib.SequenceMatcher(
        None, old.splitlines(True), new.splitlines(True), autojunk=False
    )
    ops = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    for _, i1, i2, _, _ in ops:
        assert any(
            s <= i1 and i2 <= e for s, e in spans
        ), f"unexpected change at old lines {i1 + 1}-{i2}"
    for s, e in spans:
        assert any(
            s <= i1 and i2 <= e for _, i1, i2, _, _ in ops
        ), f"no change in old lines {s + 1}-{e}"


def _unparsed(code: str) -> str:
    return ast.unparse(ast.parse(code).body[0])


def bootstrap_spans(text: str) -> List[Tuple[int, int]]:
    tree = ast.parse(text)
    # The import goes where isort puts it: right before `from sglang.srt.environ import envs`
    # (difflib may align its closing parenthesis with the one of the import above).
    environ = next(
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.environ"
    )
    branch = next(
        n for n in _top(tree, "_init_cpu_threads_env").body if isinstance(n, ast.If)
    )
    stmts = [
        s for s in branch.body if ast.unparse(s) in {_unparsed(c) for c in SHM_OLD}
    ]
    built = next(
        s
        for s in _top(tree, "_init_parallel_groups").body
        if "initialize_model_parallel(" in ast.unparse(s)
    )
    # Nothing calls upstream's helper any more: it goes, with the blank lines around it.
    helper = _top(tree, "_set_shm_master_env")
    # The comment block right above the first statement (4 lines) is replaced too.
    return [
        (environ.lineno - 2, environ.lineno - 1),
        (helper.lineno - 3, helper.end_lineno + 2),
        (stmts[0].lineno - 5, stmts[-1].end_lineno),
        (built.end_lineno, built.end_lineno),
    ]


def _imports(text: str) -> List[str]:
    return [
        ast.unparse(n) for n in ast.parse(text).body if isinstance(n, ast.ImportFrom)
    ]


def test_first_run_applies(pkg: Path, repo: Path, pristine: Path) -> None:
    r = overlay(pkg, repo)
    assert r.returncode == 0, r.stderr
    old = {rel: (pristine / rel).read_text() for rel in (BOOTSTRAP, ENGINE, ENVIRON)}
    new = {rel: (pkg / rel).read_text() for rel in (BOOTSTRAP, ENGINE, ENVIRON)}
    # Ray's _create_scheduler_actor stays as upstream wrote it: the actor binds itself.
    assert new[ENGINE] == old[ENGINE]

    assert SHM_IMPORT in _imports(new[BOOTSTRAP])
    fn = _top(ast.parse(new[BOOTSTRAP]), "_init_cpu_threads_env")
    calls = {ast.unparse(c.func): c for c in ast.walk(fn) if isinstance(c, ast.Call)}
    assert (
        "_set_shm_master_env" not in calls
        and "torch.ops.sgl_kernel.initialize" not in calls
    )
    assert "_set_shm_master_env" not in new[BOOTSTRAP]
    assert (
        "torch.ops.sgl_kernel.init_cpu_threads_env" in calls
        and "logger.warning" in calls
    )
    branch = next(n for n in fn.body if isinstance(n, ast.If))
    # Upstream's LOCAL_SIZE statement stays, right before the one new call.
    assert [ast.unparse(s) for s in branch.body[-2:]] == [
        _unparsed(SHM_KEEP),
        _unparsed(SHM_NEW),
    ]
    assert (
        "        # Set local size to hint SGLang to use shared memory based AllReduce\n"
        in new[BOOTSTRAP]
    )
    assert (
        "an inherited MASTER_ADDR/MASTER_PORT"
        in new[BOOTSTRAP].split("def _init_cpu_threads_env")[1]
    )
    assert_only_changed(old[BOOTSTRAP], new[BOOTSTRAP], bootstrap_spans(old[BOOTSTRAP]))
    # Right after sglang builds its groups, the segment names go.
    groups = _top(ast.parse(new[BOOTSTRAP]), "_init_parallel_groups").body
    at = next(
        i
        for i, s in enumerate(groups)
        if "initialize_model_parallel(" in ast.unparse(s)
    )
    assert ast.unparse(groups[at + 1]) == "finish_shm_collective()"

    envs = _top(ast.parse(new[ENVIRON]), "Envs")
    fields = {
        ast.unparse(s.targets[0]): ast.unparse(s.value)
        for s in envs.body
        if isinstance(s, ast.Assign)
    }
    assert {k: fields[k] for k in ENV_FIELDS} == ENV_FIELDS
    anchor = next(s for s in _top(ast.parse(old[ENVIRON]), "Envs").body
                  if ast.unparse(s) == "SGLANG_CRASH_ON_NUMA_BIND_FAILURE = EnvBool(False)")  # fmt: skip
    assert_only_changed(
        old[ENVIRON], new[ENVIRON], [(anchor.end_lineno, anchor.end_lineno)]
    )

    for rel, text in REPO_FILES.items():
        assert (pkg / rel).read_text() == text
        assert (pkg / rel).stat().st_mode & 0o777 == 0o644 or rel == NUMA
    for rel in (BOOTSTRAP, ENGINE, ENVIRON, NUMA):
        assert (pkg / rel).stat().st_mode == (pristine / rel).stat().st_mode
    manifest = json.loads((pkg / ".placement-overlay.json").read_text())
    assert set(manifest["added"]) == set(REPO_FILES) - {NUMA}
    assert set(manifest["replaced"]) == {BOOTSTRAP, ENVIRON, NUMA, SCHEDULER}

    # configure_scheduler_process places its rank through numa_utils: one call where
    # upstream's NUMA-blind SGLANG_SET_CPU_AFFINITY slice and the legacy bind were.
    old_s, new_s = ((p / SCHEDULER).read_text() for p in (pristine, pkg))
    body = _top(ast.parse(new_s), "configure_scheduler_process").body
    assert ast.unparse(body[-1]) == "bind_scheduler_process(server_args, gpu_id)"
    assert "set_gpu_proc_affinity" not in new_s
    assert "from sglang.srt.utils.numa_utils import bind_scheduler_process" in new_s
    removed = [line for line in difflib.ndiff(old_s.splitlines(), new_s.splitlines())
               if line.startswith("- ")]  # fmt: skip
    assert len(removed) == 9, removed  # the two imports, the comment and the block


def test_overlaid_environ_loads(pkg: Path, repo: Path) -> None:
    assert overlay(pkg, repo).returncode == 0
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('overlaid_environ', {str(pkg / ENVIRON)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)\n"
        "e = mod.envs\n"
        "print(e.SGLANG_CPU_OMP_THREADS_BIND.get())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**env, "SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0-3|4-7"]


def test_second_run_changes_nothing(pkg: Path, repo: Path) -> None:
    assert overlay(pkg, repo).returncode == 0
    before = snapshot(pkg)
    r = overlay(pkg, repo)
    assert (r.returncode, r.stderr) == (0, "") and "nothing changed" in r.stdout
    d = overlay(pkg, repo, "--diff")
    assert (d.returncode, d.stdout) == (
        0,
        "",
    ) and "0 upstream files changed" in d.stderr
    assert snapshot(pkg) == before


def test_diff_writes_nothing(pkg: Path, repo: Path, pristine: Path) -> None:
    before = snapshot(pkg)
    r = overlay(pkg, repo, "--diff")
    assert r.returncode == 0, r.stderr
    assert snapshot(pkg) == before
    for rel in (BOOTSTRAP, ENVIRON, NUMA):
        assert f"--- a/sglang/{rel}\n+++ b/sglang/{rel}\n@@ " in r.stdout
    assert f"b/sglang/{ENGINE}" not in r.stdout
    for rel in set(REPO_FILES) - {NUMA}:
        assert f"--- /dev/null\n+++ b/sglang/{rel}\n@@ -0,0 +1" in r.stdout
    n = sum(text.count("\n") for rel, text in REPO_FILES.items() if rel != NUMA)
    summary = rf"overlay --diff: 4 upstream files changed \(\+\d+ -\d+ lines\), 3 new files \({n} lines\)\n"
    assert re.fullmatch(summary, r.stderr), r.stderr
    # the printed diff is exactly what a real run then does
    assert overlay(pkg, repo).returncode == 0
    for rel in (BOOTSTRAP, ENVIRON):
        old, new = ((p / rel).read_text().splitlines(True) for p in (pristine, pkg))
        assert (
            "".join(
                difflib.unified_diff(old, new, f"a/sglang/{rel}", f"b/sglang/{rel}")
            )
            in r.stdout
        )


NUMA_ANCHOR = "    SGLANG_CRASH_ON_NUMA_BIND_FAILURE = EnvBool(False)\n"
UNKNOWN_SHAPES = {  # upstream edit -> (file, name the refusal must give)
    "no initialize call": (BOOTSTRAP, f"        {SHM_OLD[1]}\n", "", "_init_cpu_threads_env"),
    "no LOCAL_SIZE statement": (BOOTSTRAP, f"        {SHM_KEEP}\n", "", "_init_cpu_threads_env"),
    "no group build": (BOOTSTRAP, "    initialize_model_parallel(\n", "    initialize_model_parallel_v2(\n",
                       "_init_parallel_groups"),
    "conflicting env field": (ENVIRON, NUMA_ANCHOR, NUMA_ANCHOR + '    SGLANG_CPU_OMP_THREADS_BIND = EnvStr("0")\n',
                              "Envs.SGLANG_CPU_OMP_THREADS_BIND"),
    "no affinity step": (SCHEDULER, "        set_gpu_proc_affinity(gpu_id)\n", "        pass\n",
                         "configure_scheduler_process"),
}  # fmt: skip


@pytest.mark.parametrize("shape", UNKNOWN_SHAPES)
@pytest.mark.parametrize("diff", [False, True])
def test_refuses_unknown_upstream_shape(
    pkg: Path, repo: Path, shape: str, diff: bool
) -> None:
    rel, old, new, name = UNKNOWN_SHAPES[shape]
    edit(pkg / rel, old, new)
    before = snapshot(pkg)
    r = overlay(pkg, repo, *(["--diff"] if diff else []))
    assert (r.returncode, r.stdout) == (2, "")
    assert (
        len(r.stderr.splitlines()) == 1 and rel in r.stderr and name in r.stderr
    ), r.stderr
    assert (
        snapshot(pkg) == before
    )  # nothing written: no new module, no manifest, no rewrite


@pytest.mark.parametrize(
    "stand_in", ["srt/server_args.py", "__init__.py", "srt/__init__.py"]
)
def test_refuses_stand_ins_of_upstream_modules(
    pkg: Path, repo: Path, stand_in: str
) -> None:
    (repo / "sglang" / stand_in).write_text("# a stand-in\n")
    before = snapshot(pkg)
    r = overlay(pkg, repo)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert str(repo / "sglang" / stand_in) in r.stderr and "OWNED_WHOLE" in r.stderr
    assert snapshot(pkg) == before


def test_module_deleted_from_repo_is_removed(pkg: Path, repo: Path) -> None:
    assert overlay(pkg, repo).returncode == 0
    (repo / "sglang/srt/placement/plan.py").unlink()
    r = overlay(pkg, repo)
    assert r.returncode == 0 and "deleted sglang/srt/placement/plan.py" in r.stdout
    assert (
        not (pkg / "srt/placement/plan.py").exists()
        and (pkg / "srt/placement/__init__.py").exists()
    )
    py_compile.compile(
        str(pkg / "srt/placement/__init__.py"), doraise=True
    )  # a __pycache__ must not keep it
    shutil.rmtree(repo / "sglang/srt/placement")
    assert overlay(pkg, repo).returncode == 0
    assert not (pkg / "srt/placement").exists()
    manifest = json.loads((pkg / ".placement-overlay.json").read_text())
    assert manifest["added"] == ["srt/distributed/shm_collective.py"]
    assert "nothing changed" in overlay(pkg, repo).stdout


def test_hard_linked_copy_stays_pristine(
    pkg: Path, repo: Path, link_source: Path
) -> None:
    touched = (BOOTSTRAP, ENVIRON, NUMA, SCHEDULER)
    assert all(
        (pkg / r).stat().st_ino == (link_source / r).stat().st_ino for r in touched
    )
    assert overlay(pkg, repo).returncode == 0
    assert all(
        (pkg / r).stat().st_ino != (link_source / r).stat().st_ino for r in touched
    )
    assert (pkg / "srt/server_args.py").stat().st_ino == (
        link_source / "srt/server_args.py"
    ).stat().st_ino
    assert (pkg / ENGINE).stat().st_ino == (link_source / ENGINE).stat().st_ino
    assert not [p for p in pkg.rglob("*overlay-tmp*")]


def test_refuses_what_is_not_a_package(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "sglang" / "srt").mkdir(parents=True)  # no __init__.py, no version.py
    r = overlay(tmp_path / "sglang", repo)
    assert (
        r.returncode == 2
        and len(r.stderr.splitlines()) == 1
        and "not an sglang package dir" in r.stderr
    )


def test_libcst_missing_is_a_one_line_refusal(repo: Path, tmp_path: Path) -> None:
    (tmp_path / "libcst.py").write_text("raise ImportError('no libcst here')\n")
    cmd = [sys.executable, str(OVERLAY), str(tmp_path), "--repo-python", str(repo)]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert (
        r.returncode == 2
        and len(r.stderr.splitlines()) == 1
        and "pip install libcst" in r.stderr
    )


# --------------------------------------------------------------------------- a checkout: python/sglang and test/

PORTED = "registered/utils/test_numa_utils.py"
PORTED_NEW = "registered/utils/test_numa_utils_xpu.py"
UPSTREAM_TEST = "from sglang.srt.utils.numa_utils import _probe_numactl_args  # upstream's, 0.5.23\n"
REPO_TESTS = {  # the repo's tests/upstream/
    "__init__.py": '"""Package markers let pytest tell these from tests/ files of the same name."""\n',
    "registered/__init__.py": "",
    "registered/utils/__init__.py": "",
    PORTED: "import unittest\n\nclass TestPorted(unittest.TestCase):\n    pass\n",
    PORTED_NEW: "import unittest\n\nclass TestXpu(unittest.TestCase):\n    pass\n",
}
REAL_REPO = OVERLAY.parent.parent
HARNESS_DIR = REAL_REPO / "tests" / "harness"


@pytest.fixture
def checkout(link_source: Path, tmp_path: Path) -> Path:
    """An sglang checkout: python/sglang (a hard-link copy of the pristine package) and upstream's test/."""
    root = tmp_path / "checkout"
    shutil.copytree(link_source, root / "python" / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for rel, text in {PORTED: UPSTREAM_TEST, "registered/utils/test_other.py": "# upstream's\n",
                      "run_suite.py": "# upstream's runner\n"}.items():  # fmt: skip
        (root / "test" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "test" / rel).write_text(text)
    return root


@pytest.fixture
def repo_tests(repo: Path) -> Path:
    """The fake repo with ported upstream tests beside its python/ dir."""
    for rel, text in REPO_TESTS.items():
        (repo.parent / "tests" / "upstream" / rel).parent.mkdir(
            parents=True, exist_ok=True
        )
        (repo.parent / "tests" / "upstream" / rel).write_text(text)
    return repo


def test_checkout_gets_the_package_and_the_ported_tests(
    checkout: Path, repo_tests: Path, pristine: Path
) -> None:
    other = (checkout / "test/registered/utils/test_other.py").stat()
    r = overlay(checkout, repo_tests)
    assert r.returncode == 0, r.stderr
    pkg = checkout / "python" / "sglang"
    for rel, text in REPO_FILES.items():
        assert (pkg / rel).read_text() == text
    assert SHM_IMPORT in _imports((pkg / BOOTSTRAP).read_text())
    # Upstream's test of the same path is replaced by the port; a new port is added; nothing else changes.
    assert (checkout / "test" / PORTED).read_text() == REPO_TESTS[PORTED]
    assert (checkout / "test" / PORTED_NEW).read_text() == REPO_TESTS[PORTED_NEW]
    assert not list((checkout / "test").rglob("__init__.py"))
    assert (checkout / "test/registered/utils/test_other.py").stat() == other
    assert (checkout / "test/run_suite.py").read_text() == "# upstream's runner\n"
    lines = r.stdout.splitlines()
    assert f"replaced test/{PORTED} (upstream's test, ported)" in lines
    assert f"added test/{PORTED_NEW}" in lines
    assert (
        f"rewrote python/sglang/{BOOTSTRAP}" in lines
        and f"added python/sglang/{'srt/placement/plan.py'}" in lines
    )
    assert (
        lines[-1] == f"overlay: {len(REPO_FILES) + 3 + 2} file(s) changed in {checkout}"
    )
    manifest = json.loads((pkg / ".placement-overlay.json").read_text())
    assert manifest["tests_added"] == [PORTED_NEW]
    assert set(manifest["added"]) == set(REPO_FILES) - {NUMA}


def test_checkout_second_run_changes_nothing(checkout: Path, repo_tests: Path) -> None:
    assert overlay(checkout, repo_tests).returncode == 0
    before = snapshot(checkout)
    r = overlay(checkout, repo_tests)
    assert (r.returncode, r.stderr) == (
        0,
        "",
    ) and r.stdout == f"overlay: nothing changed; {checkout} is up to date\n"
    d = overlay(checkout, repo_tests, "--diff")
    assert (d.returncode, d.stdout) == (
        0,
        "",
    ) and "0 upstream files changed" in d.stderr
    # The package dir on its own is up to date too, and keeps the checkout's record of its tests.
    p = overlay(checkout / "python" / "sglang", repo_tests)
    assert p.returncode == 0 and "nothing changed" in p.stdout
    assert snapshot(checkout) == before


def test_checkout_diff_names_checkout_paths_and_writes_nothing(
    checkout: Path, repo_tests: Path
) -> None:
    before = snapshot(checkout)
    r = overlay(checkout, repo_tests, "--diff")
    assert r.returncode == 0, r.stderr
    assert snapshot(checkout) == before
    for rel in (BOOTSTRAP, ENVIRON, NUMA):
        assert f"--- a/python/sglang/{rel}\n+++ b/python/sglang/{rel}\n@@ " in r.stdout
    assert (
        f"--- a/test/{PORTED}\n+++ b/test/{PORTED}\n@@ -1 +1,4 @@\n-{UPSTREAM_TEST}+import unittest\n"
        in r.stdout
    )
    assert f"--- /dev/null\n+++ b/test/{PORTED_NEW}\n@@ -0,0 +1,4 @@\n" in r.stdout
    assert not re.search(r"^\+\+\+ b/test/.*__init__\.py$", r.stdout, re.M)
    assert "a/sglang/" not in r.stdout and "b/sglang/" not in r.stdout
    n = sum(t.count("\n") for rel, t in REPO_FILES.items() if rel != NUMA) + REPO_TESTS[
        PORTED_NEW
    ].count("\n")
    summary = rf"overlay --diff: 5 upstream files changed \(\+\d+ -\d+ lines\), 4 new files \({n} lines\)\n"
    assert re.fullmatch(summary, r.stderr), r.stderr
    # The diff is the pull request against the checkout: it applies at its root as it is.
    check = subprocess.run(["git", "apply", "--check", "-"], input=r.stdout, cwd=checkout, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_checkout_port_removed_from_the_repo_is_deleted(
    checkout: Path, repo_tests: Path
) -> None:
    assert overlay(checkout, repo_tests).returncode == 0
    (repo_tests.parent / "tests" / "upstream" / PORTED_NEW).unlink()
    (repo_tests.parent / "tests" / "upstream" / PORTED).write_text("# ported again\n")
    r = overlay(checkout, repo_tests)
    assert r.returncode == 0, r.stderr
    assert f"deleted test/{PORTED_NEW} (no longer in the repo)" in r.stdout.splitlines()
    assert f"replaced test/{PORTED} (upstream's test, ported)" in r.stdout.splitlines()
    assert not (checkout / "test" / PORTED_NEW).exists()
    assert (
        checkout / "test" / PORTED
    ).read_text() == "# ported again\n"  # upstream's path is kept
    assert (checkout / "test/registered/utils/test_other.py").exists()
    assert "tests_added" not in json.loads(
        (checkout / "python/sglang/.placement-overlay.json").read_text()
    )


@pytest.mark.parametrize(
    "problem", ["no test dir", "unknown upstream shape", "dir in the way"]
)
def test_checkout_refusals_write_nothing(
    checkout: Path, repo_tests: Path, problem: str
) -> None:
    if problem == "no test dir":
        shutil.rmtree(checkout / "test")
        want = f"{checkout} is not an sglang package dir"
    elif problem == "unknown upstream shape":
        rel, old, new, name = UNKNOWN_SHAPES["no initialize call"]
        edit(checkout / "python" / "sglang" / rel, old, new)
        want = name
    else:
        (checkout / "test" / PORTED_NEW).mkdir()
        want = f"test/{PORTED_NEW}: the checkout has a non-file or a file-as-directory in the way"
    before = snapshot(checkout)
    for args in ((), ("--diff",)):
        r = overlay(checkout, repo_tests, *args)
        assert (r.returncode, r.stdout) == (2, "") and len(
            r.stderr.splitlines()
        ) == 1, r.stderr
        assert want in r.stderr, r.stderr
    assert snapshot(checkout) == before


def test_package_dir_leaves_the_ported_tests_alone(pkg: Path, repo_tests: Path) -> None:
    r = overlay(pkg, repo_tests)
    assert r.returncode == 0, r.stderr
    assert "test/" not in r.stdout and not (pkg.parent / "test").exists()
    assert "tests_added" not in json.loads(
        (pkg / ".placement-overlay.json").read_text()
    )


def test_real_ported_tests_run_in_an_overlaid_checkout(checkout: Path) -> None:
    """The repo's own ports, copied by the overlay, pass from the checkout with nothing of tests/ on the path,
    and sglang's CI collector sees them registered for the CPU suite."""
    from sglang.test.ci.ci_register import HWBackend, ut_parse_one_file

    r = overlay(checkout, REAL_REPO / "python")
    assert r.returncode == 0, r.stderr
    ported = sorted((REAL_REPO / "tests" / "upstream").rglob("test_*.py"))
    copied = [
        checkout / "test" / p.relative_to(REAL_REPO / "tests" / "upstream")
        for p in ported
    ]
    assert [c.read_bytes() for c in copied] == [p.read_bytes() for p in ported]
    assert {"test_shm_group.py", "test_resolve.py"} < {p.name for p in ported}
    # The tests of sgl-kernel's CPU build run where upstream has it (base-b, as
    # test/registered/cpu/test_comm.py); here, without SGLANG_CPU_KERNEL, they skip.
    kernel_suite = [(HWBackend.CPU, "base-b-test-cpu")]
    needs_kernel = []
    for path in copied:
        registry, _ = ut_parse_one_file(str(path))
        found = [(e.backend, e.suite) for e in registry]
        assert found in ([(HWBackend.CPU, "base-a-test-cpu")], kernel_suite), path
        needs_kernel += [path] if found == kernel_suite else []
    assert all("import sgl_kernel" in p.read_text() for p in needs_kernel)
    env = full_import_env()
    # sglang.test.test_utils (CustomTestCase) imports Hugging Face datasets, which
    # upstream's CI installs and this environment does not: only its stand-in joins.
    (checkout / "standins").mkdir()
    shutil.copy(HARNESS_DIR / "datasets.py", checkout / "standins")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(checkout / "python"), str(checkout / "standins")]
    )
    where = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert where.stdout.strip() == str(
        checkout / "python" / "sglang" / "__init__.py"
    ), where
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *map(str, copied),
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=checkout / "test", env=env
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    skipped = len(needs_kernel)  # a module without sgl_kernel skips whole
    assert re.search(
        rf"\d+ passed, {skipped} skipped", out.stdout.splitlines()[-1]
    ), out.stdout[-2000:]
