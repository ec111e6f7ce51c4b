#!/usr/bin/env python3
"""The upstream pull requests in ``upstream_prs/``, as a stack on pristine sglang 0.5.23.

    python scripts/stack.py checkout DIR [--upstream SRC]   pristine checkout in DIR (a git repo)
    python scripts/stack.py apply DIR                        each pull request in order, a commit each
    python scripts/stack.py export DIR                       DIR's commits back into upstream_prs/
    python scripts/stack.py report [DIR]                     changed lines per pull request; with an
                                                             applied DIR, the lines a later one deletes

A pull request is ``upstream_prs/NNNN-name/`` holding ``fix.patch`` (``git apply -p1`` at a
checkout's root) and ``DESCRIPTION.md``. A checkout is the wheel's package as ``python/sglang``
and a ``test/registered/``; with ``--upstream SRC`` (an sglang source tree of the same time) it
also holds SRC's files that the stack changes but the wheel lacks: upstream's own tests, and the
sgl-kernel sources a kernel pull request patches. Without them, those files' hunks are left out
(``excluded``) and a pull request that changes nothing else is not applied.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
STACK = REPO / "upstream_prs"
PRISTINE = (
    Path(os.environ.get("SGLANG_PRISTINE_DIR") or REPO / ".venv" / "pristine")
    / "sglang"
)
MAX_LINES = 250
_DIR = re.compile(r"\d{4}-[a-z0-9][a-z0-9-]*")
_GIT = ("git", "-c", "user.name=stack", "-c", "user.email=stack@localhost")


@dataclass(frozen=True)
class PullRequest:
    name: str
    patch: Path
    description: Path

    @property
    def title(self) -> str:
        return self.description.read_text().splitlines()[0].lstrip("# ").strip()

    def paths(self) -> list[tuple[str, bool]]:
        """(path, new file) for each file the patch touches, in its order."""
        found = []
        for block in re.split(r"^diff --git ", self.patch.read_text(), flags=re.M)[1:]:
            path = block.split("\n", 1)[0].split(" b/", 1)[1]
            found.append((path, "\nnew file mode " in block.split("@@", 1)[0]))
        return found

    def lines(self) -> tuple[int, int]:
        """(added, removed), headers left out."""
        added = removed = 0
        for line in self.patch.read_text().splitlines():
            if line.startswith("+") and not line.startswith("+++ "):
                added += 1
            elif line.startswith("-") and not line.startswith("--- "):
                removed += 1
        return added, removed


def pull_requests(stack: Path = STACK) -> list[PullRequest]:
    dirs = sorted(d for d in stack.iterdir() if d.is_dir())
    bad = [d.name for d in dirs if not _DIR.fullmatch(d.name)]
    if bad:
        raise ValueError(f"{stack}: {bad} are not NNNN-name directories")
    return [PullRequest(d.name, d / "fix.patch", d / "DESCRIPTION.md") for d in dirs]


def git(*argv: str, cwd: Path, check: bool = True) -> str:
    done = subprocess.run(
        [*_GIT, *argv], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} in {cwd}: {done.stderr.strip()}")
    return done.stdout


def make_checkout(
    dest: Path, *, upstream: Optional[Path] = None, stack: Path = STACK
) -> Path:
    """A pristine checkout in ``dest`` (new), committed as one git commit."""
    (dest / "python").mkdir(parents=True)
    shutil.copytree(PRISTINE, dest / "python" / "sglang", ignore=_bytecode)
    (dest / "test" / "registered").mkdir(parents=True)
    if upstream is not None:
        changed = [p for pr in pull_requests(stack) for p, new in pr.paths() if not new]
        for path in changed:
            source, target = upstream / path, dest / path
            if source.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    git("init", "-q", cwd=dest)
    git("add", "-A", cwd=dest)
    git("commit", "-q", "-m", "pristine sglang 0.5.23", cwd=dest)
    return dest


def _bytecode(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def excluded(pr: PullRequest, checkout: Path) -> list[str]:
    """Files ``pr`` changes that ``checkout`` does not hold (upstream's, not the wheel's)."""
    return [p for p, new in pr.paths() if not new and not (checkout / p).exists()]


def apply(pr: PullRequest, checkout: Path, *, commit: bool = False) -> list[str]:
    """Apply ``pr``, less its hunks for files the checkout lacks; returns those files."""
    left_out = excluded(pr, checkout)
    if len(left_out) == len(pr.paths()):
        return left_out
    options = [f"--exclude={p}" for p in left_out]
    git("apply", "-p1", *options, str(pr.patch), cwd=checkout)
    if commit:
        git("add", "-A", cwd=checkout)
        git("commit", "-q", "--allow-empty", "-m", pr.name, cwd=checkout)
    return left_out


def later_deletions(checkout: Path) -> dict[str, int]:
    """For an applied checkout (one commit per pull request): per pull request, its
    added lines that a later one deletes."""
    commits = git("rev-list", "--reverse", "HEAD", cwd=checkout).split()
    names = {
        c: git("log", "-1", "--format=%s", c, cwd=checkout).strip() for c in commits
    }
    counts = {names[c]: 0 for c in commits[1:]}
    for parent, child in zip(commits, commits[1:]):
        for path, spans in _deleted(checkout, parent, child):
            origin = _blame(checkout, parent, path)
            for start, length in spans:
                for line in range(start, start + length):
                    if origin[line] != commits[0]:
                        counts[names[origin[line]]] += 1
    return counts


def _deleted(checkout: Path, a: str, b: str) -> Iterator[tuple[str, list]]:
    diff = git("diff", "-U0", "--no-renames", a, b, cwd=checkout)
    for block in re.split(r"^diff --git ", diff, flags=re.M)[1:]:
        head = re.search(r"^--- a/(.+)$", block, flags=re.M)
        spans = [
            (int(m[1]), int(m[2]) if m[2] is not None else 1)
            for m in re.finditer(r"^@@ -(\d+)(?:,(\d+))? ", block, flags=re.M)
        ]
        spans = [(s, n) for s, n in spans if n]
        if head and spans:
            yield head[1], spans


def _blame(checkout: Path, commit: str, path: str) -> dict[int, str]:
    out = git("blame", "--porcelain", commit, "--", path, cwd=checkout)
    origin = {}
    for m in re.finditer(r"^([0-9a-f]{40}) \d+ (\d+)", out, flags=re.M):
        origin[int(m[2])] = m[1]
    return origin


def export(checkout: Path, stack: Path = STACK) -> list[str]:
    """Write each commit after the first as ``stack/<subject>/fix.patch``."""
    commits = git("rev-list", "--reverse", "HEAD", cwd=checkout).split()
    written = []
    for parent, child in zip(commits, commits[1:]):
        name = git("log", "-1", "--format=%s", child, cwd=checkout).strip()
        if not _DIR.fullmatch(name):
            raise ValueError(f"commit {child[:10]}: subject {name!r} is no NNNN-name")
        diff = git("diff", "--no-renames", "--full-index", parent, child, cwd=checkout)
        (stack / name).mkdir(parents=True, exist_ok=True)
        (stack / name / "fix.patch").write_text(diff)
        written.append(name)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("checkout")
    made.add_argument("dir", type=Path)
    made.add_argument("--upstream", type=Path)
    for name in ("apply", "export"):
        sub.add_parser(name).add_argument("dir", type=Path)
    sub.add_parser("report").add_argument("dir", type=Path, nargs="?")
    args = parser.parse_args(argv)
    if args.command == "checkout":
        make_checkout(args.dir, upstream=args.upstream)
    elif args.command == "apply":
        for pr in pull_requests():
            left_out = apply(pr, args.dir, commit=True)
            print(pr.name, f"(left out: {', '.join(left_out)})" if left_out else "")
    elif args.command == "export":
        print("\n".join(export(args.dir)))
    else:
        deletions = later_deletions(args.dir) if args.dir else {}
        total_added = total_deleted = 0
        for pr in pull_requests():
            added, removed = pr.lines()
            total_added += added
            total_deleted += deletions.get(pr.name, 0)
            print(f"{pr.name:40} {added + removed:5} lines (+{added} -{removed})")
        if args.dir:
            share = 100 * total_deleted / max(total_added, 1)
            print(
                f"{total_deleted} of {total_added} added lines deleted later ({share:.2f}%)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
