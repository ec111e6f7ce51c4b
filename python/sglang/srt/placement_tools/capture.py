"""capture: the sysfs files placement reads, copied into a new directory, so that
``plan --sysfs-root DIR`` plans that host elsewhere."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile

from sglang.srt.placement_tools.plan import (
    SNAPSHOT_MARKER,
    UsageError,
    check_snapshot,
    sysfs_files,
)


def capture(dest: str, *, root: str = "/sys") -> int:
    """Copy ``root``'s files (``sysfs_files``) and a marker into ``dest``, a new or
    empty directory; return how many. Written into a private directory beside it and
    renamed into place, so a failed capture leaves nothing."""
    check_snapshot(root)
    dest = os.path.abspath(dest)
    parent = os.path.dirname(dest)
    if os.path.islink(dest) or os.path.lexists(dest) and not os.path.isdir(dest):
        raise UsageError(f"DIR {dest}: exists and is not a directory; give a new one")
    if os.path.isdir(dest) and os.listdir(dest):
        raise UsageError(f"DIR {dest}: is not empty; give a new or empty directory")
    if not os.path.isdir(parent):
        raise UsageError(f"DIR {dest}: its parent {parent} is not a directory")
    files = list(sysfs_files(root))
    try:
        scratch = tempfile.mkdtemp(prefix=".capture-", dir=parent)
    except OSError as e:
        raise UsageError(f"DIR {dest}: cannot write in {parent} ({e.strerror})")
    try:
        for rel in files:
            os.makedirs(os.path.dirname(os.path.join(scratch, rel)), exist_ok=True)
            shutil.copyfile(os.path.join(root, rel), os.path.join(scratch, rel))
        marker = {
            "format": 1,
            "source_root": os.path.abspath(root),
            "kernel_release": os.uname().release,
            "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
        }
        with open(os.path.join(scratch, SNAPSHOT_MARKER), "w") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
        os.chmod(scratch, 0o755)
        os.rename(scratch, dest)  # replaces an empty directory
    except BaseException as e:
        shutil.rmtree(scratch, ignore_errors=True)  # the directory made above
        if isinstance(e, OSError):
            why = f"{e.filename}: {e.strerror or e}"
            raise UsageError(f"{why}; nothing was written to {dest}") from None
        raise
    return len(files)
