"""``overlay.py --series OUT CHECKOUT``: the change as patches a reviewer takes in order.

For a pristine sglang checkout (``python/sglang`` and ``test/``, left untouched)
it writes, in ``OUT``, ``series`` (the patch names in order) and:

1. each upstream fix as stored (``upstream_prs/NNNN-<name>/fix.patch``), under the
   title of its pull-request description (``DESCRIPTION.md``);
2. the refactor: the diff from the checkout with the fixes applied to what
   ``overlay.py CHECKOUT`` makes less the operator tools, cut in ``PARTS``;
3. the operator tools: the diff from that to what ``overlay.py CHECKOUT`` makes.

Every patch applies with ``git apply -p1`` at the checkout's root, in order; after
the last, the checkout is what ``overlay.py CHECKOUT`` makes. Every state a patch
leaves holds files at their final content or as a fix left them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from overlay import Change, Refusal, Target, unified_diff

#: Beside the repo's python/: one NNNN-<name>/ dir per fix (fix.patch, DESCRIPTION.md).
FIXES = "upstream_prs"
#: The refactor after the fixes, in order: (name, subject, the paths it takes). A
#: path goes to the first part with a prefix it starts with; the part with none
#: takes the rest. The CPU collective's shm namespace needs nothing of placement,
#: and nothing below the tools imports them.
PARTS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    (
        "shm-namespace",
        "distributed: the CPU collective's /dev/shm segments named by an explicit "
        "ShmNamespace, not by MASTER_ADDR/MASTER_PORT",
        ("python/sglang/srt/distributed/", "test/registered/distributed/"),
    ),
    (
        "placement",
        "placement: where each scheduler rank runs, decided once from the host's "
        "facts and applied by exec under numactl or in-process",
        (
            "python/sglang/srt/placement/",
            "python/sglang/srt/scheduler_placement/",
            "python/sglang/srt/environ.py",
            "test/registered/placement/",
        ),
    ),
    (
        "numa-utils-on-placement",
        "numa_utils, SchedulerActor: every launcher places its ranks through placement",
        (),
    ),
    (
        "placement-tools",
        "placement_tools: plan, capture and verify a host's placement",
        ("python/sglang/srt/placement_tools/", "test/registered/placement_tools/"),
    ),
)


def _git_apply(patches: Sequence[Path], cwd: Path, *options: str) -> str:
    # Never inside an enclosing repository: there git sees only the paths under cwd.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.resolve().parent)}
    done = subprocess.run(
        ["git", "apply", "-p1", *options, *(str(p.resolve()) for p in patches)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        names = ", ".join(str(p) for p in patches)
        raise Refusal(f"git apply {names} in {cwd}: {done.stderr.strip()}")
    return done.stdout


def numstat(patch: Path) -> List[Tuple[int, int, str]]:
    """(added, removed, path) of each file a patch changes, as git counts them."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = _git_apply([patch], Path(tmp), "--numstat").splitlines()
    return [(int(a), int(r), path) for a, r, path in (row.split("\t") for row in rows)]


def fixes(where: Path) -> List[Tuple[str, str, Path]]:
    """(name, title, fix.patch) of each upstream fix in ``where``, in order."""
    found = []
    for patch in sorted(where.glob("*/fix.patch")):
        first = (patch.parent / "DESCRIPTION.md").read_text().partition("\n")[0]
        name = re.sub(r"^\d+-", "", patch.parent.name)
        title = first[2:].strip() if first.startswith("# ") else name
        found.append((name, title, patch))
    return found


def fixed(root: Path, patches: Sequence[Path]) -> Dict[str, Optional[bytes]]:
    """Each path the fixes touch, as they leave it applied to ``root`` (None: no file)."""
    paths = sorted({path for p in patches for _, _, path in numstat(p)})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rel in paths:
            if (root / rel).is_file():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / rel, work / rel)
        _git_apply(patches, work)
        return {
            rel: (work / rel).read_bytes() if (work / rel).is_file() else None
            for rel in paths
        }


def _part(path: str) -> str:
    rest = next(name for name, _, prefixes in PARTS if not prefixes)
    return next(
        (name for name, _, prefixes in PARTS if prefixes and path.startswith(prefixes)),
        rest,
    )


def build(
    target: Target, changes: Sequence[Change], fixes_dir: Path
) -> List[Tuple[str, str, str]]:
    """(name, subject, diff) of each patch, in order.

    ``changes`` are what ``overlay.py`` writes into the checkout, each shown by its
    path there (``python/sglang/...`` or ``test/...``).
    """
    root = target.root
    found = fixes(fixes_dir)
    built = [(name, title, patch.read_text()) for name, title, patch in found]
    before = fixed(root, [patch for _, _, patch in found])
    after = {c.shown: c.new for c in changes}
    parts: Dict[str, List[Change]] = {name: [] for name, _, _ in PARTS}
    for path in sorted(before.keys() | after.keys()):
        upstream = (root / path).read_bytes() if (root / path).is_file() else None
        old, new = before.get(path, upstream), after.get(path, upstream)
        if old != new:
            area, rel = path.split("/", 1)
            kind = "added" if old is None else "deleted" if new is None else "updated"
            parts[_part(path)].append(Change(rel, old, new, 0o644, kind, area=area))
    for name, subject, _ in PARTS:
        diff = "".join(line for c in parts[name] for line in unified_diff(c)[0])
        built += [(name, subject, diff)] if diff else []
    return built


def write(
    out: Path, target: Target, changes: Sequence[Change], fixes_dir: Path
) -> List[str]:
    """Write the series into ``out`` (new, or an empty dir: ``overlay.py`` checks);
    returns one line per patch: its name, its changed lines and the total so far."""
    built = build(target, changes, fixes_dir)
    out.mkdir(parents=True, exist_ok=True)
    names, summary, total = [], [], 0
    for index, (name, subject, diff) in enumerate(built, 1):
        names.append(f"{index:04d}-{name}.patch")
        patch = out / names[-1]
        head = f"Subject: [PATCH {index}/{len(built)}] {subject}\n---\n"
        patch.write_text(head + diff)
        lines = sum(added + removed for added, removed, _ in numstat(patch))
        total += lines
        summary.append(f"{patch.name}  {lines:4d} lines  {total:5d} in all  {subject}")
    (out / "series").write_text("".join(f"{n}\n" for n in names))
    return summary
