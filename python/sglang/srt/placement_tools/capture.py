"""Copy the sysfs files placement reads into a small directory, to plan for that host elsewhere.

``python -m sglang.srt.placement_tools capture DIR`` on the serving host, then
``--sysfs-root DIR`` anywhere: ``read_topology(DIR)`` gives the same topology as
``read_topology("/sys")`` did on that host (only ``root`` differs).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import os
import posixpath
import stat
from typing import Optional

from sglang.srt.placement.cpulist import shown
from sglang.srt.placement.topology import (
    SNAPSHOT_FORMAT,
    SNAPSHOT_MARKER,
    TopologyRead,
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

    ``dest`` must not exist, or be an empty directory that this process's user owns and that
    no group or other user may write to. PCI device links become plain directories holding
    just the files read. A marker file (format version, kernel release, capture time) lets
    later errors say the tree is a snapshot.

    Nothing is written by path: ``dest`` is opened once (never through a symlink) and every
    directory and file below it is created relative to a directory descriptor, so a symlink
    planted meanwhile is refused rather than followed.
    """
    dest_text = os.path.abspath(os.fspath(dest))
    if "\0" in dest_text:
        raise CaptureError(
            f"{shown(dest_text)}: a path cannot hold a NUL byte; choose another directory"
        )
    with _Destination(dest_text) as out:
        try:
            read = _read(root, setting="--sysfs-root")
            for rel, text in sorted(_snapshot_files(read).items()):
                out.write_new(rel, text)
        except BaseException as exc:
            out.remove_created()
            if isinstance(exc, OSError):
                raise CaptureError(
                    f"{dest_text}: cannot write the snapshot ({exc.strerror or exc}); nothing was left behind"
                ) from None
            raise
        # Read back through the descriptor: whatever the path names by now, this is what was written.
        readback_root = out.proc_path() or dest_text
        copied = read_topology(readback_root)
    if copied != _with_root(read.topology, readback_root):
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


def _snapshot_files(read: TopologyRead) -> dict[str, str]:
    """The files of a snapshot of ``read``: what was read, and the marker."""
    marker = {
        "format": SNAPSHOT_FORMAT,
        "kernel_release": os.uname().release,
        "captured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "source_root": read.topology.root,
    }
    if read.memory_kb_from_sysconf is not None:
        # Such a kernel has no file stating the memory size; the marker carries it.
        marker["memory_kb"] = read.memory_kb_from_sysconf
    files = dict(read.files)
    files[SNAPSHOT_MARKER] = json.dumps(marker, indent=2, sort_keys=True) + "\n"
    return files


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Destination:
    """The snapshot directory, held open: creates directories and files below it through descriptors only,
    and removes what it created (through the same descriptors) on request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: dict[str, int] = {}
        """Relative directory ("" for the destination itself) -> its open descriptor."""
        self.created: list[tuple[str, str, bool]] = []
        """(relative parent directory, name, is a directory), in creation order."""
        self.parent_fd: Optional[int] = None
        self.created_top = False

    def __enter__(self) -> "_Destination":
        parent, name = os.path.split(self.path)
        if not name:
            raise CaptureError(
                f"{self.path}: is not a new or empty directory; choose one for the snapshot"
            )
        try:
            # The parent may be reached through links (the user named it); the destination itself may not.
            self.parent_fd = os.open(
                parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            raise CaptureError(
                f"{self.path}: its parent {parent} does not exist or is not a directory; create it first or "
                "choose another place"
            ) from None
        try:
            self._open_top(name)
        except BaseException:
            self.remove_created()
            self.close()
            raise
        return self

    def _open_top(self, name: str) -> None:
        try:
            os.mkdir(name, mode=_DIR_MODE, dir_fd=self.parent_fd)
            self.created_top = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise CaptureError(
                f"{self.path}: cannot be created ({exc.strerror}); choose another place"
            ) from None
        try:
            fd = os.open(name, _OPEN_DIR, dir_fd=self.parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CaptureError(
                    f"{self.path}: exists and is not a directory; choose a new directory for the snapshot"
                ) from None
            raise CaptureError(
                f"{self.path}: cannot be opened ({exc.strerror}); choose another place"
            ) from None
        self.fds[""] = fd
        st = os.fstat(fd)
        # Created here or not, the directory written into must be this user's alone: a directory that
        # another user owns or may write to could have links planted in it while the capture runs.
        if st.st_uid != os.geteuid():
            raise CaptureError(
                f"{self.path}: belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); a capture "
                "writes only into a directory of its own: choose a new directory"
            )
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise CaptureError(
                f"{self.path}: may be written by other users (mode {stat.S_IMODE(st.st_mode):o}); a capture "
                "writes only into a directory of its own: choose a new directory"
            )
        if not self.created_top and os.listdir(fd):
            raise CaptureError(
                f"{self.path}: is not empty; choose a new or empty directory for the snapshot "
                "(a capture never overwrites files)"
            )

    def _dir_fd(self, rel_dir: str) -> int:
        """The descriptor of ``rel_dir`` below the destination, creating it (and those above) if need be."""
        if rel_dir in self.fds:
            return self.fds[rel_dir]
        parent_rel, name = posixpath.split(rel_dir)
        parent_fd = self._dir_fd(parent_rel)
        try:
            # os.makedirs would give intermediate directories the umask's mode, which may be world-writable.
            os.mkdir(name, mode=_DIR_MODE, dir_fd=parent_fd)
            self.created.append((parent_rel, name, True))
        except FileExistsError:
            pass  # made for an earlier file of this capture; opened below without following a link
        self.fds[rel_dir] = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
        return self.fds[rel_dir]

    def write_new(self, rel: str, text: str) -> None:
        """Create ``rel`` holding ``text``; O_EXCL: a capture only ever creates files, never follows or
        overwrites an existing one."""
        parent_rel, name = posixpath.split(rel)
        parent_fd = self._dir_fd(parent_rel)
        fd = os.open(name, _CREATE_FILE, _FILE_MODE, dir_fd=parent_fd)
        self.created.append((parent_rel, name, False))
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("ascii", errors="replace"))

    def proc_path(self) -> Optional[str]:
        """A path that reaches the destination through its open descriptor, where /proc offers one."""
        path = f"/proc/self/fd/{self.fds['']}"
        return path if os.path.isdir(path) else None

    def remove_created(self) -> None:
        for parent_rel, name, is_dir in reversed(self.created):
            try:
                if is_dir:
                    fd = self.fds.pop(posixpath.join(parent_rel, name), None)
                    if fd is not None:
                        os.close(fd)
                    os.rmdir(name, dir_fd=self.fds[parent_rel])
                else:
                    os.unlink(name, dir_fd=self.fds[parent_rel])
            except OSError:
                logger.warning(
                    f"Could not remove {posixpath.join(self.path, parent_rel, name)} after a failed capture"
                )
        self.created.clear()
        if self.created_top and "" in self.fds:
            top = os.fstat(self.fds[""])
            os.close(self.fds.pop(""))
            name = os.path.basename(self.path)
            try:
                now = os.stat(name, dir_fd=self.parent_fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (top.st_dev, top.st_ino):
                    os.rmdir(name, dir_fd=self.parent_fd)
            except OSError:
                logger.warning(f"Could not remove {self.path} after a failed capture")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        if self.parent_fd is not None:
            os.close(self.parent_fd)
            self.parent_fd = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _with_root(topology: HostTopology, root: str) -> HostTopology:
    return dataclasses.replace(topology, root=root)
