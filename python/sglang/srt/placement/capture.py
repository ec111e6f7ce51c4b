"""Copy the sysfs files placement reads into a small directory, to plan for that host elsewhere.

``python -m sglang.srt.placement capture DIR`` on the serving host, then
``--sysfs-root DIR`` anywhere: ``read_topology(DIR)`` gives the same topology as
``read_topology("/sys")`` did on that host (only ``root`` differs).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os

from sglang.srt.placement.topology import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_MARKER,
    _read,
    read_topology,
)
from sglang.srt.placement.types import HostTopology, TopologyError

logger = logging.getLogger(__name__)

_DIR_MODE = 0o755
_FILE_MODE = 0o644


class CaptureError(TopologyError):
    """A snapshot cannot be written where asked, or did not read back the same."""


def capture_sysfs(dest: str | os.PathLike, *, root: str | os.PathLike = "/sys") -> int:
    """Copy exactly the files ``read_topology(root)`` reads into ``dest``; return how many.

    ``dest`` must not exist or be an empty directory. PCI device links become plain
    directories holding just the files read. A marker file (format version, kernel
    release, capture time) lets later errors say the tree is a snapshot.
    """
    dest_text = os.path.abspath(os.fspath(dest))
    _check_dest(dest_text)
    read = _read(root)

    marker = {
        "format": SNAPSHOT_FORMAT,
        "kernel_release": os.uname().release,
        "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source_root": read.topology.root,
    }
    if read.memory_kb_from_sysconf is not None:
        # Such a kernel has no file stating the memory size; the marker carries it.
        marker["memory_kb"] = read.memory_kb_from_sysconf
    files = dict(read.files)
    files[SNAPSHOT_MARKER] = json.dumps(marker, indent=2, sort_keys=True) + "\n"

    created: list[str] = []
    try:
        if not os.path.isdir(dest_text):
            os.mkdir(dest_text, mode=_DIR_MODE)
            created.append(dest_text)
        for rel, text in sorted(files.items()):
            path = os.path.join(dest_text, rel)
            _make_dirs(dest_text, os.path.dirname(rel), created)
            _write_new(path, text)
            created.append(path)
    except OSError as exc:
        _remove(created)
        raise CaptureError(f"{dest_text}: cannot write the snapshot ({exc}); nothing was left behind") from None

    copied = read_topology(dest_text)
    if copied != _with_root(read.topology, dest_text):
        raise CaptureError(
            f"{dest_text}: the snapshot does not read back as the topology of {read.topology.root} "
            "although it holds the very text that was read; this is a bug, please report it with the snapshot"
        )
    logger.info(
        f"Captured {len(read.files)} sysfs files from {read.topology.root} into {dest_text}: "
        f"{len(copied.nodes)} NUMA nodes, {len(copied.online_cpus)} online CPUs, "
        f"{len(copied.pci_devices)} PCI devices"
    )
    return len(read.files)


def _check_dest(dest: str) -> None:
    if os.path.lexists(dest):
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise CaptureError(f"{dest}: exists and is not a directory; choose a new directory for the snapshot")
        if os.listdir(dest):
            raise CaptureError(
                f"{dest}: is not empty; choose a new or empty directory for the snapshot "
                "(a capture never overwrites files)"
            )
        return
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise CaptureError(f"{dest}: its parent {parent} does not exist; create it first or choose another place")


def _make_dirs(dest: str, rel_dir: str, created: list[str]) -> None:
    # os.makedirs gives intermediate directories the umask's mode, which may be world-writable.
    path = dest
    for part in rel_dir.split("/") if rel_dir else ():
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path, mode=_DIR_MODE)
            created.append(path)


def _remove(created: list[str]) -> None:
    for path in reversed(created):
        try:
            if os.path.isdir(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            logger.warning(f"Could not remove {path} after a failed capture")


def _write_new(path: str, text: str) -> None:
    # O_EXCL: a capture only ever creates files, never follows or overwrites an existing one.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    with os.fdopen(fd, "w", encoding="ascii", errors="replace") as f:
        f.write(text)


def _with_root(topology: HostTopology, root: str) -> HostTopology:
    return dataclasses.replace(topology, root=root)
