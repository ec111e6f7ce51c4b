#!/usr/bin/env python3
"""Overlay this repository's sglang modules onto an installed sglang package or an sglang checkout.

Copies the project's own modules into the package and rewrites a few upstream
call sites (with libcst, leaving the rest of each file byte-identical) so that
they delegate into those modules; ``--diff`` prints the change instead.

Usage: python scripts/overlay.py TARGET [--diff] [--repo-python DIR]

TARGET is an sglang package dir (an installed ``site-packages/sglang``, or a
checkout's ``python/sglang``), or an sglang checkout (a dir holding
``python/sglang`` and ``test/``). For a checkout, upstream's own tests as this
repo ports them (``tests/upstream/``, beside ``--repo-python``) go to the same
paths under the checkout's ``test/`` as well, and ``--diff`` names every file
by its path in the checkout. The same change as upstream pull requests, in
merge order, is ``upstream_prs/`` (``scripts/stack.py``).

Exit status: 0 done (or nothing to do), 2 refused (upstream is not the shape
this script knows, or bad input; nothing is written), 1 I/O error.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import json
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

try:
    import libcst as cst
except ImportError:  # reported by main() as a refusal, with the fix
    cst = None  # type: ignore[assignment]

#: Upstream modules the project owns whole: the repo's copy replaces them.
OWNED_WHOLE = ("srt/utils/numa_utils.py", "srt/ray/scheduler_actor.py")
MANIFEST_NAME = ".placement-overlay.json"
#: The repo's ports of upstream's own tests, relative to the repo root, in upstream's test/ layout.
UPSTREAM_TESTS = Path("tests") / "upstream"
NEW_FILE_MODE = 0o644
REPO_ROOT = Path(__file__).resolve().parent.parent


class Refusal(Exception):
    """The input or upstream's code is not what this script knows; nothing is written."""


@dataclass(frozen=True)
class Manifest:
    """What earlier runs did: package paths relative to the package dir, test paths to the checkout's test/."""

    added: FrozenSet[str] = frozenset()
    replaced: FrozenSet[str] = frozenset()
    tests_added: FrozenSet[str] = frozenset()

    def dumps(self) -> bytes:
        body = {
            "format": 1,
            "added": sorted(self.added),
            "replaced": sorted(self.replaced),
        }
        if self.tests_added:
            body["tests_added"] = sorted(self.tests_added)
        return (json.dumps(body, indent=2) + "\n").encode()


@dataclass(frozen=True)
class Target:
    """Where the overlay writes: the package, and for a checkout its test/ dir."""

    pkg: Path
    tests: Optional[Path] = None
    """The checkout's test/ dir; None for a package dir."""

    @property
    def root(self) -> Path:
        return self.pkg if self.tests is None else self.tests.parent

    @property
    def pkg_label(self) -> str:
        """How paths in the package are shown: relative to its parent, or to the checkout."""
        return "sglang" if self.tests is None else "python/sglang"


@dataclass(frozen=True)
class Change:
    """One file the run writes (``new``) or deletes (``new is None``)."""

    rel: str
    old: Optional[bytes]
    new: Optional[bytes]
    mode: int
    kind: str  # "added", "updated", "replaced", "rewrote" or "deleted"
    area: str = "sglang"
    """The dir ``rel`` is under, as shown: "sglang", or in a checkout "python/sglang" or "test"."""

    @property
    def upstream(self) -> bool:
        return self.kind in ("replaced", "rewrote")

    @property
    def shown(self) -> str:
        return f"{self.area}/{self.rel}"


# --------------------------------------------------------------------------
# libcst helpers


def _ast_key(code: str) -> Optional[str]:
    """A formatting- and comment-insensitive key for a snippet of Python code."""
    try:
        return ast.dump(ast.parse(code.strip()))
    except SyntaxError:
        return None


def _same(module: "cst.Module", node: "cst.CSTNode", code: str) -> bool:
    return _ast_key(module.code_for_node(node)) == _ast_key(code)


def _one_line(module: "cst.Module", node: "cst.CSTNode") -> str:
    if isinstance(node, cst.SimpleStatementLine):
        node = node.with_changes(leading_lines=())
    return " ".join(module.code_for_node(node).split())


def _statement(code: str, blank_lines: int = 0) -> "cst.BaseStatement":
    """Parse one statement; ``blank_lines`` empty lines go before it."""
    stmt = cst.parse_statement(code)
    return stmt.with_changes(leading_lines=[cst.EmptyLine(indent=False)] * blank_lines)


def _top_level(
    module: "cst.Module", kind: type, name: str, where: str
) -> "cst.CSTNode":
    found = [s for s in module.body if isinstance(s, kind) and s.name.value == name]
    what = "class" if kind is cst.ClassDef else "def"
    if len(found) != 1:
        raise Refusal(
            f"{where}: expected exactly one top-level `{what} {name}`, found {len(found)}"
        )
    if not isinstance(found[0].body, cst.IndentedBlock):
        raise Refusal(f"{where}: expected `{what} {name}` to have an indented body")
    return found[0]


def _is_import(stmt: "cst.BaseStatement") -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def _from_module(module: "cst.Module", stmt: "cst.BaseStatement") -> Optional[str]:
    """The module of a top-level ``from X import ...`` statement, else None."""
    if not _is_import(stmt):
        return None
    node = ast.parse(module.code_for_node(stmt).strip()).body[0]
    return node.module if isinstance(node, ast.ImportFrom) and not node.level else None


def _add_import_sorted(module: "cst.Module", line: str, where: str) -> "cst.Module":
    """Add the ``from X import ...`` statement ``line`` unless it is there already:
    before the first top-level ``from`` import of the same top package whose module
    sorts after X (where isort's black profile puts it), else after the last import."""
    body = list(module.body)
    if any(
        isinstance(s, cst.SimpleStatementLine) and _same(module, s, line) for s in body
    ):
        return module
    imports = [i for i, s in enumerate(body) if _is_import(s)]
    if not imports:
        raise Refusal(f"{where}: expected top-level import statements, found none")
    ours = ast.parse(line).body[0].module
    package = ours.split(".")[0]
    at = next(
        (
            i
            for i in imports
            if (name := _from_module(module, body[i])) is not None
            and name.split(".")[0] == package
            and name.lower() > ours.lower()
        ),
        imports[-1] + 1,
    )
    body.insert(at, _statement(line + "\n"))
    return module.with_changes(body=body)


# --------------------------------------------------------------------------
# The two rewrites of upstream files: each returns the module unchanged when
# it is already applied, and raises Refusal when upstream is not the known shape.

SHM_IMPORT = (
    "from sglang.srt.distributed.shm_collective import (\n"
    "    finish_shm_collective,\n"
    "    start_shm_collective,\n"
    ")"
)
CPU_BRANCH = "_is_cpu_amx_available or _is_cpu_arm64"
#: Kept as upstream has it: parallel_state's GroupCoordinator reads LOCAL_SIZE and
#: uses the shared-memory all-reduce only when it equals the group's size.
SHM_KEEP = 'os.environ["LOCAL_SIZE"] = str(parallel.tp_size)'
#: Replaced: the segment names come from an explicit ShmNamespace instead.
SHM_MASTER_ENV = "_set_shm_master_env"
SHM_OLD = (
    f"{SHM_MASTER_ENV}(dist_init_method)",
    "torch.ops.sgl_kernel.initialize(parallel.tp_size, parallel.tp_rank)",
)
SHM_COMMENT = (
    "# This stage's /dev/shm segments are named by its own init address, never by",
    "# an inherited MASTER_ADDR/MASTER_PORT: co-located engines never share them.",
)
SHM_NEW = (
    "start_shm_collective(\n"
    "    dist_init_method=dist_init_method,\n"
    "    tp_size=parallel.tp_size,\n"
    "    tp_rank=parallel.tp_rank,\n"
    "    pp_rank=parallel.pp_rank,\n"
    ")\n"
)
#: After this call in `_init_parallel_groups` the TP group exists: FINISH ends the
#: shared-memory all-reduce's set-up (a barrier and the unlink, or the kernel's group).
GROUPS_BUILT = "initialize_model_parallel"
FINISH = "finish_shm_collective()\n"
FINISH_COMMENT = (
    "# The TP group exists: the CPU shared-memory all-reduce finishes its set-up,",
    "# and no /dev/shm name of this stage is left once every rank is past it.",
)


def _find_run(
    module: "cst.Module", stmts: Sequence["cst.BaseStatement"], codes: Sequence[str]
) -> Optional[int]:
    """Index where ``codes`` occur as consecutive statements of ``stmts``."""
    for i in range(len(stmts) - len(codes) + 1):
        if all(_same(module, stmts[i + k], c) for k, c in enumerate(codes)):
            return i
    return None


def rewrite_bootstrap(module: "cst.Module", rel: str) -> "cst.Module":
    """Import the shm collective API and delegate the CPU shm all-reduce setup to it.

    Upstream's ``LOCAL_SIZE`` statement and its comment stay; the
    ``_set_shm_master_env`` and ``sgl_kernel.initialize`` calls after it become one
    ``start_shm_collective(...)`` call, ``_set_shm_master_env`` goes once nothing
    calls it, and ``finish_shm_collective()`` follows the
    ``initialize_model_parallel(...)`` call of ``_init_parallel_groups``.
    """
    module = _add_import_sorted(module, SHM_IMPORT, f"sglang/{rel}")
    module = _rewrite_groups(_rewrite_cpu_env(module, rel), rel)
    return _drop_if_unused(module, SHM_MASTER_ENV)


def _drop_if_unused(module: "cst.Module", name: str) -> "cst.Module":
    """``module`` without its top-level ``def name`` when no other code names it."""
    defs = [s for s in module.body if isinstance(s, cst.FunctionDef)]
    found = [s for s in defs if s.name.value == name]
    rest = [s for s in module.body if s not in found]
    if not found or any(name in module.code_for_node(s) for s in rest):
        return module
    return module.with_changes(body=rest)


def _rewrite_groups(module: "cst.Module", rel: str) -> "cst.Module":
    where = f"sglang/{rel}: _init_parallel_groups()"
    func = _top_level(module, cst.FunctionDef, "_init_parallel_groups", where)
    stmts = list(func.body.body)
    built = [
        i
        for i, s in enumerate(stmts)
        if isinstance(s, cst.SimpleStatementLine)
        and isinstance(s.body[0], cst.Expr)
        and isinstance(s.body[0].value, cst.Call)
        and _same(module, s.body[0].value.func, GROUPS_BUILT)
    ]
    finishes = [i for i, s in enumerate(stmts) if _same(module, s, FINISH)]
    if len(built) != 1 or finishes not in ([], [built[0] + 1]):
        raise Refusal(
            f"{where}: expected one `{GROUPS_BUILT}(...)` call statement, followed "
            f"by nothing or by `{FINISH.strip()}`"
        )
    if finishes:
        return module
    comment = [cst.EmptyLine(comment=cst.Comment(line)) for line in FINISH_COMMENT]
    stmts.insert(built[0] + 1, _statement(FINISH).with_changes(leading_lines=comment))
    return module.deep_replace(
        func, func.with_changes(body=func.body.with_changes(body=stmts))
    )


def _rewrite_cpu_env(module: "cst.Module", rel: str) -> "cst.Module":
    where = f"sglang/{rel}: _init_cpu_threads_env()"
    func = _top_level(module, cst.FunctionDef, "_init_cpu_threads_env", where)
    branch = next(
        (
            s
            for s in func.body.body
            if isinstance(s, cst.If) and _same(module, s.test, CPU_BRANCH)
        ),
        None,
    )
    known = (SHM_KEEP, *SHM_OLD)
    expected = (
        f"the statements `{'`, `'.join(known)}` in a row inside `if {CPU_BRANCH}:`"
    )
    if branch is None or not isinstance(branch.body, cst.IndentedBlock):
        raise Refusal(f"{where}: expected {expected}; found no such `if` branch")
    stmts = list(branch.body.body)
    old_at = _find_run(module, stmts, known)
    new_at = _find_run(module, stmts, (SHM_KEEP, SHM_NEW))
    calls = [i for i, s in enumerate(stmts) if _same(module, s, SHM_NEW)]
    if old_at is None and new_at is not None and len(calls) == 1:
        return module
    if old_at is None or calls:
        raise Refusal(
            f"{where}: expected {expected}, or `{SHM_KEEP}` followed by one "
            "start_shm_collective(...) call instead of the last two"
        )
    # The comment above _set_shm_master_env says MASTER_ADDR/PORT name the segments:
    # say what names them now.
    replaced = stmts[old_at + 1]
    blank = [line for line in replaced.leading_lines if line.comment is None][:1]
    blank = [cst.EmptyLine(indent=False)] if blank else []
    comment = [cst.EmptyLine(comment=cst.Comment(line)) for line in SHM_COMMENT]
    call = _statement(SHM_NEW).with_changes(leading_lines=[*blank, *comment])
    stmts[old_at + 1 : old_at + len(known)] = [call]
    body = branch.body.with_changes(body=stmts)
    return module.deep_replace(branch, branch.with_changes(body=body))


ENV_ANCHOR = "SGLANG_CRASH_ON_NUMA_BIND_FAILURE = EnvBool(False)"
ENV_FIELDS = (
    ("SGLANG_CPU_OMP_THREADS_BIND", 'SGLANG_CPU_OMP_THREADS_BIND = EnvStr("all")'),
)

#: configure_scheduler_process's own placement (upstream's NUMA-blind CPU slice, then
#: the legacy bind) becomes one call that applies the rank's one placement.
PLACE_OLD = (
    "if envs.SGLANG_SET_CPU_AFFINITY.get():\n    set_gpu_proc_affinity(gpu_id)\n",
    "if not envs.SGLANG_NUMA_BIND_V2.get():\n"
    "    numa_node = get_numa_node_if_available(server_args, gpu_id)\n"
    "    if numa_node is not None:\n"
    "        numa_bind_to_node(numa_node)\n",
)
PLACE_NEW = "bind_scheduler_process(server_args, gpu_id)\n"
PLACE_COMMENT = (
    "# This rank's one placement (its NUMA node; with SGLANG_SET_CPU_AFFINITY=1 its",
    "# slice of that node's cores), applied here where the launcher could not: a Ray",
    "# actor, the legacy V1 bind, the NUMA-blind slice where no node is known.",
)
PLACE_IMPORT_OLD = (
    "from sglang.srt.utils.numa_utils import get_numa_node_if_available, "
    "numa_bind_to_node"
)
PLACE_IMPORT_NEW = "from sglang.srt.utils.numa_utils import bind_scheduler_process"
UNUSED_AFTER = "set_gpu_proc_affinity"


def rewrite_scheduler(module: "cst.Module", rel: str) -> "cst.Module":
    """``configure_scheduler_process`` places the rank through ``numa_utils``."""
    where = f"sglang/{rel}: configure_scheduler_process()"
    func = _top_level(module, cst.FunctionDef, "configure_scheduler_process", where)
    stmts = list(func.body.body)
    old_at = _find_run(module, stmts, PLACE_OLD)
    calls = [i for i, s in enumerate(stmts) if _same(module, s, PLACE_NEW)]
    if old_at is None and len(calls) == 1:
        return module
    if old_at is None or calls:
        raise Refusal(
            f"{where}: expected `{' '.join(PLACE_OLD[0].split())}` followed by the "
            "legacy NUMA bind `if not envs.SGLANG_NUMA_BIND_V2.get(): ...`, or one "
            f"`{PLACE_NEW.strip()}` instead"
        )
    blank = [line for line in stmts[old_at].leading_lines if line.comment is None][:1]
    comment = [cst.EmptyLine(comment=cst.Comment(line)) for line in PLACE_COMMENT]
    call = _statement(PLACE_NEW).with_changes(leading_lines=[*blank, *comment])
    stmts[old_at : old_at + len(PLACE_OLD)] = [call]
    module = module.deep_replace(
        func, func.with_changes(body=func.body.with_changes(body=stmts))
    )
    body = [
        _statement(PLACE_IMPORT_NEW + "\n") if _same(module, s, PLACE_IMPORT_OLD) else s
        for s in module.body
    ]
    module = module.with_changes(body=body)
    if not any(_same(module, s, PLACE_IMPORT_NEW) for s in module.body):
        raise Refusal(f"sglang/{rel}: expected the import `{PLACE_IMPORT_OLD}`")
    return _drop_imported_name(module, UNUSED_AFTER, rel)


def _drop_imported_name(module: "cst.Module", name: str, rel: str) -> "cst.Module":
    """``module`` without ``name`` in its top-level ``from sglang.srt.utils import
    (...)`` once nothing else names it."""
    code = module.code
    if code.count(name) != 1:
        return module
    for stmt in module.body:
        if _from_module(module, stmt) != "sglang.srt.utils":
            continue
        imports = stmt.body[0]
        kept = [a for a in imports.names if a.name.value != name]
        if len(kept) == len(imports.names):
            continue
        last = kept[-1].with_changes(comma=imports.names[-1].comma)
        new = imports.with_changes(names=[*kept[:-1], last])
        return module.deep_replace(imports, new)
    raise Refusal(f"sglang/{rel}: expected `{name}` in `from sglang.srt.utils import`")


def _assigns(stmt: "cst.BaseStatement", name: str) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        targets = (
            [t.target for t in small.targets] if isinstance(small, cst.Assign) else []
        )
        if isinstance(small, cst.AnnAssign):
            targets = [small.target]
        if any(isinstance(t, cst.Name) and t.value == name for t in targets):
            return True
    return False


def rewrite_environ(module: "cst.Module", rel: str) -> "cst.Module":
    """Add the project's environment variables to `Envs`, after the NUMA bind ones."""
    where = f"sglang/{rel}: Envs"
    _top_level(module, cst.ClassDef, "EnvStr", f"sglang/{rel}: EnvStr")
    cls = _top_level(module, cst.ClassDef, "Envs", where)
    stmts = list(cls.body.body)
    missing: List[str] = []
    for name, code in ENV_FIELDS:
        defs = [s for s in stmts if _assigns(s, name)]
        if not defs:
            missing.append(code)
        elif not all(_same(module, d, code) for d in defs):
            found = "; ".join(_one_line(module, d) for d in defs)
            raise Refusal(
                f"{where}.{name}: already defined as `{found}`, expected `{code}`"
            )
    if not missing:
        return module
    anchor = next(
        (i for i, s in enumerate(stmts) if _same(module, s, ENV_ANCHOR)), None
    )
    if anchor is None:
        raise Refusal(
            f"{where}: expected the statement `{ENV_ANCHOR}` in the class body"
        )
    stmts[anchor + 1 : anchor + 1] = [_statement(code + "\n") for code in missing]
    return module.deep_replace(
        cls, cls.with_changes(body=cls.body.with_changes(body=stmts))
    )


REWRITES: Dict[str, Callable[["cst.Module", str], "cst.Module"]] = {
    "srt/distributed/bootstrap.py": rewrite_bootstrap,
    "srt/environ.py": rewrite_environ,
    "srt/managers/scheduler.py": rewrite_scheduler,
}


# --------------------------------------------------------------------------
# Planning: everything is checked and computed before anything is written.


def _check_package(pkg: Path) -> None:
    if not (
        pkg.is_dir()
        and (pkg / "srt").is_dir()
        and (pkg / "__init__.py").is_file()
        and (pkg / "version.py").is_file()
    ):
        raise Refusal(
            f"{pkg} is not an sglang package dir (it needs srt/, __init__.py and version.py)"
        )


def _load_manifest(pkg: Path) -> Optional[Manifest]:
    path = pkg / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        added, replaced, tests_added = (
            data["added"],
            data["replaced"],
            data.get("tests_added", []),
        )
        if not isinstance(tests_added, list) or not all(
            isinstance(p, str) for p in [*added, *replaced, *tests_added]
        ):
            raise TypeError("paths must be strings")
    except (ValueError, KeyError, TypeError) as e:
        raise Refusal(
            f"{path}: unreadable overlay manifest ({e}); restore it or start from a pristine package"
        ) from None
    return Manifest(frozenset(added), frozenset(replaced), frozenset(tests_added))


def find_target(path: Path) -> Target:
    """The package dir itself, or a checkout: a dir holding python/sglang (a package dir) and test/."""
    try:
        _check_package(path)
        return Target(pkg=path)
    except Refusal:
        pass
    pkg = path / "python" / "sglang"
    if (path / "test").is_dir() and pkg.is_dir():
        _check_package(pkg)
        return Target(pkg=pkg, tests=path / "test")
    raise Refusal(
        f"{path} is not an sglang package dir (it needs srt/, __init__.py and version.py) nor an sglang "
        "checkout (it needs python/sglang and test/)"
    )


def _repo_files(repo_sglang: Path) -> Dict[str, Path]:
    """The repo's files under sglang/, by path relative to it; caches skipped."""
    found: Dict[str, Path] = {}
    for root, dirs, files in os.walk(repo_sglang):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in files:
            if not name.endswith((".pyc", ".pyo")):
                path = Path(root, name)
                found[path.relative_to(repo_sglang).as_posix()] = path
    return dict(sorted(found.items()))


def _check_target(
    pkg: Path, rel: str, *, shown: str = "", owner: str = "the package"
) -> None:
    target = pkg / rel
    blockers = [
        p
        for p in target.parents
        if p != pkg and pkg in p.parents and p.exists() and not p.is_dir()
    ]
    if blockers or (target.exists() and not target.is_file()):
        raise Refusal(
            f"{shown or f'sglang/{rel}'}: {owner} has a non-file or a file-as-directory in the way"
        )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) if path.exists() else NEW_FILE_MODE


def _rewrite(
    pkg: Path, rel: str, rewrite: Callable[["cst.Module", str], "cst.Module"]
) -> Optional[Change]:
    path = pkg / rel
    if not path.is_file():
        raise Refusal(f"sglang/{rel}: upstream file not found in the package")
    old = path.read_bytes()
    try:
        new = rewrite(cst.parse_module(old), rel).bytes
    except cst.ParserSyntaxError as e:
        raise Refusal(
            f"sglang/{rel}: does not parse: {str(e).splitlines()[0]}"
        ) from None
    return None if new == old else Change(rel, old, new, _mode(path), "rewrote")


def plan(
    pkg: Path, repo_sglang: Path, manifest: Optional[Manifest]
) -> Tuple[List[Change], Manifest]:
    """The changes that bring ``pkg`` up to date, and the manifest to write after them.

    Refuses repo files that stand in for upstream ones: an upstream path other
    than OWNED_WHOLE, or an ``__init__.py`` in an upstream directory (it would
    replace upstream's or turn an upstream namespace package into a regular one).
    """
    prior = manifest or Manifest()
    repo = _repo_files(repo_sglang)

    def upstream(rel: str) -> bool:
        return (pkg / rel).exists() and rel not in prior.added

    def upstream_dir(rel: str) -> bool:  # holds a file that no overlay run added
        parent = (pkg / rel).parent
        return parent.is_dir() and any(
            f.is_file() and f.relative_to(pkg).as_posix() not in prior.added
            for f in parent.iterdir()
        )

    standins = [
        rel
        for rel in repo
        if (upstream(rel) and rel not in OWNED_WHOLE)
        or (
            rel.rsplit("/", 1)[-1] == "__init__.py"
            and rel not in prior.added
            and upstream_dir(rel)
        )
    ]
    if standins:
        raise Refusal(
            f"{', '.join(str(repo_sglang / r) for r in standins)}: stand-in(s) of upstream sglang modules or "
            "packages; the repo must not replace upstream modules other than OWNED_WHOLE "
            f"({', '.join(OWNED_WHOLE)})"
        )
    changes: List[Change] = []
    for rel, src in repo.items():
        _check_target(pkg, rel)
        target, new = pkg / rel, src.read_bytes()
        old = target.read_bytes() if target.exists() else None
        if old != new:
            kind = (
                "replaced" if upstream(rel) else ("added" if old is None else "updated")
            )
            changes.append(Change(rel, old, new, _mode(target), kind))
    for rel, rewrite in REWRITES.items():
        change = _rewrite(pkg, rel, rewrite)
        changes += [change] if change else []
    gone = sorted(rel for rel in prior.added - repo.keys() if (pkg / rel).is_file())
    changes += [
        Change(rel, (pkg / rel).read_bytes(), None, 0, "deleted") for rel in gone
    ]
    after = Manifest(
        added=frozenset(rel for rel in repo if not upstream(rel)),
        replaced=prior.replaced
        | {rel for rel in repo if upstream(rel)}
        | frozenset(REWRITES),
        tests_added=prior.tests_added,
    )
    return changes, after


def plan_tests(
    tests: Path, repo_tests: Path, manifest: Manifest
) -> Tuple[List[Change], Manifest]:
    """The changes that bring a checkout's ``test/`` dir up to date with the repo's ``tests/upstream/``.

    A ported test replaces upstream's file of the same path. The repo's package
    markers (``__init__.py``, which let pytest tell these files from ``tests/``
    files of the same name) stay behind: upstream's test dirs are not packages.
    """
    repo = {
        rel: path
        for rel, path in (
            _repo_files(repo_tests) if repo_tests.is_dir() else {}
        ).items()
        if rel.rsplit("/", 1)[-1] != "__init__.py"
    }
    changes: List[Change] = []
    for rel, src in repo.items():
        _check_target(tests, rel, shown=f"test/{rel}", owner="the checkout")
        target, new = tests / rel, src.read_bytes()
        old = target.read_bytes() if target.exists() else None
        if old != new:
            if old is None:
                kind = "added"
            else:
                kind = "updated" if rel in manifest.tests_added else "replaced"
            changes.append(Change(rel, old, new, _mode(target), kind, area="test"))
    gone = sorted(
        rel for rel in manifest.tests_added - repo.keys() if (tests / rel).is_file()
    )
    changes += [
        Change(rel, (tests / rel).read_bytes(), None, 0, "deleted", area="test")
        for rel in gone
    ]
    added = {
        rel for rel in repo if rel in manifest.tests_added or not (tests / rel).exists()
    }
    return changes, dataclasses.replace(manifest, tests_added=frozenset(added))


# --------------------------------------------------------------------------
# Writing (never through an existing path: the package may be a hard-link copy)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".overlay-tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _delete(pkg: Path, rel: str) -> None:
    """Delete an added file, its bytecode, and the directories this leaves empty."""
    path = pkg / rel
    path.unlink()
    cache = path.parent / "__pycache__"
    for pyc in cache.glob(f"{path.stem}.*.pyc") if path.suffix == ".py" else ():
        pyc.unlink()
    for d in (cache, *path.parents):
        if d == pkg or pkg not in d.parents:
            break
        with contextlib.suppress(OSError):  # not empty, or absent
            d.rmdir()


def apply(target: Target, changes: Sequence[Change], manifest: Manifest) -> None:
    for c in changes:
        base = target.tests if c.area == "test" else target.pkg
        if c.new is None:
            _delete(base, c.rel)
        else:
            _write_atomic(base / c.rel, c.new, c.mode)
        replaced = (
            " (upstream's test, ported)" if c.area == "test" else " (owned whole)"
        )
        note = {"replaced": replaced, "deleted": " (no longer in the repo)"}.get(
            c.kind, ""
        )
        print(f"{c.kind} {c.shown}{note}")
    manifest_path = target.pkg / MANIFEST_NAME
    if not manifest_path.exists() or manifest_path.read_bytes() != manifest.dumps():
        _write_atomic(manifest_path, manifest.dumps(), NEW_FILE_MODE)
    if changes:
        print(f"overlay: {len(changes)} file(s) changed in {target.root}")
    else:
        print(f"overlay: nothing changed; {target.root} is up to date")


# --------------------------------------------------------------------------
# --diff


def _lines(data: Optional[bytes]) -> List[str]:
    if data is None:
        return []
    parts = data.decode("utf-8").split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    return lines + ([parts[-1]] if parts[-1] else [])


def unified_diff(change: Change) -> Tuple[List[str], int, int]:
    """``diff -u`` text for one change, and its counts of added and removed lines."""
    a = f"a/{change.shown}" if change.old is not None else "/dev/null"
    b = f"b/{change.shown}" if change.new is not None else "/dev/null"
    try:
        old, new = _lines(change.old), _lines(change.new)
    except UnicodeDecodeError:
        return [f"Binary files {a} and {b} differ\n"], 0, 0
    out = list(difflib.unified_diff(old, new, a, b))
    body = out[2:]
    added = sum(1 for line in body if line.startswith("+"))
    removed = sum(1 for line in body if line.startswith("-"))
    out = [
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
        for line in out
    ]
    return out, added, removed


def print_diff(changes: Sequence[Change]) -> str:
    """Print the diff of ``changes`` to stdout; return the one-line summary."""
    counts = {
        k: [0, 0, 0] for k in ("upstream", "added", "updated", "deleted")
    }  # files, +, -
    for c in sorted(changes, key=lambda c: (not c.upstream, c.shown)):
        text, plus, minus = unified_diff(c)
        sys.stdout.write("".join(text))
        bucket = counts["upstream" if c.upstream else c.kind]
        bucket[0], bucket[1], bucket[2] = (
            bucket[0] + 1,
            bucket[1] + plus,
            bucket[2] + minus,
        )
    up, new, upd, gone = (
        counts[k] for k in ("upstream", "added", "updated", "deleted")
    )
    parts = [
        f"{up[0]} upstream files changed (+{up[1]} -{up[2]} lines)",
        f"{new[0]} new files ({new[1]} lines)",
    ]
    parts += (
        [f"{upd[0]} overlay files updated (+{upd[1]} -{upd[2]} lines)"]
        if upd[0]
        else []
    )
    parts += [f"{gone[0]} overlay files deleted ({gone[2]} lines)"] if gone[0] else []
    return "overlay --diff: " + ", ".join(parts)


# --------------------------------------------------------------------------


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "target",
        type=Path,
        metavar="TARGET",
        help="an sglang package dir, or an sglang checkout (python/sglang and test/): then the ported "
        "upstream tests go to its test/ too",
    )
    parser.add_argument(
        "--diff", action="store_true", help="print the unified diff; write nothing"
    )
    parser.add_argument(
        "--repo-python",
        type=Path,
        default=REPO_ROOT / "python",
        metavar="DIR",
        help="the repo's python/ dir (holding sglang/); the ported upstream tests are in its sibling "
        "tests/upstream/",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if cst is None:
        raise Refusal(
            f"libcst is not installed; install it with `{sys.executable} -m pip install libcst`"
        )
    target = find_target(args.target.resolve())
    pkg = target.pkg
    repo_sglang = (args.repo_python / "sglang").resolve()
    if not repo_sglang.is_dir():
        raise Refusal(
            f"{repo_sglang} is not a directory (--repo-python must contain sglang/)"
        )
    if repo_sglang == pkg:
        raise Refusal(f"{pkg} is the repo's own sglang dir, not an installed package")
    changes, manifest = plan(pkg, repo_sglang, _load_manifest(pkg))
    if target.tests is not None:
        changes = [dataclasses.replace(c, area=target.pkg_label) for c in changes]
        test_changes, manifest = plan_tests(
            target.tests, args.repo_python.resolve().parent / UPSTREAM_TESTS, manifest
        )
        changes += test_changes
    if args.diff:
        print(print_diff(changes), file=sys.stderr)
    else:
        apply(target, changes, manifest)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        return run(args)
    except Refusal as e:
        print(f"overlay: refused: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"overlay: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
