#!/usr/bin/env python3
"""Write this repository's change into an sglang 0.5.23 package: the pull requests in
``upstream_prs/`` in merge order (their ``python/sglang`` hunks, less the kernel's sources), then the operator tools
(``python/sglang/srt/placement_tools``), which are not part of the stack.

    python scripts/overlay.py PACKAGE [--check]

PACKAGE is a pristine sglang 0.5.23 package directory: an installed
``site-packages/sglang``, or a checkout's ``python/sglang``. Every patch is tried on a copy
first: the package changes only if all apply. ``--check`` writes nothing.

Exit status: 0 done, 2 refused (not a pristine 0.5.23 package: nothing is written).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
STACK = REPO / "upstream_prs"
TOOLS = Path("srt") / "placement_tools"


def patches(stack: Path = STACK) -> list[Path]:
    """Each pull request's ``fix.patch``, in merge order."""
    return sorted(stack.glob("[0-9][0-9][0-9][0-9]-*/fix.patch"))


def apply_patch(package: Path, patch: Path) -> Optional[str]:
    """Applies ``patch``'s ``python/sglang`` hunks in ``package``; the repository a
    package may sit in (a virtual environment in a checkout) is not used. Returns why
    it does not apply, or None."""
    # The kernel's sources are not in the package: sgl-kernel builds them.
    paths = ["--exclude=sglang/kernels/aot/*", "--include=sglang/*"]
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(package.parent.parent)}
    done = subprocess.run(
        ["git", "apply", "-p2", "--allow-empty", *paths, str(patch)],
        cwd=package.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        return f"{patch.parent.name} does not apply: {done.stderr.strip()}"
    return None


def apply_patches(package: Path) -> Optional[str]:
    """Applies each patch in order (``git apply`` of several at once checks each
    against the original files); returns why one does not apply, or None."""
    for patch in patches():
        why = apply_patch(package, patch)
        if why is not None:
            return why
    return None


def overlay(package: Path, *, check: bool = False) -> Optional[str]:
    """Applies the change to ``package``; returns why not, or None."""
    if not (package / "srt" / "utils" / "numa_utils.py").is_file():
        return f"{package}: not an sglang package (no srt/utils/numa_utils.py)"
    if package.name != "sglang":
        return f"{package}: the package directory must be named sglang"
    if (package / TOOLS).exists():
        return f"{package}: {TOOLS} is there already: overlay a pristine package"
    # First on a copy of hard links (git apply replaces a file, never writes through
    # a link): a package is changed only once every patch applies.
    with tempfile.TemporaryDirectory(dir=package.parent.parent) as scratch:
        trial = Path(scratch) / "sglang"
        shutil.copytree(package, trial, copy_function=os.link)
        why = apply_patches(trial)
    if why is not None:
        return f"{package}: not a pristine sglang 0.5.23? {why}"
    if not check:
        apply_patches(package)
        shutil.copytree(
            REPO / "python" / "sglang" / TOOLS,
            package / TOOLS,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--check", action="store_true", help="write nothing")
    args = parser.parse_args(argv)
    why = overlay(args.package.resolve(), check=args.check)
    if why is not None:
        print(f"overlay: {why}", file=sys.stderr)
        return 2
    print(f"overlay: {len(patches())} pull requests and the tools in {args.package}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
