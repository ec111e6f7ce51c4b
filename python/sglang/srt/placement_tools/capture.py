"""A host's sysfs files that placement reads, copied so as to plan for it elsewhere."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import posixpath
import stat
from typing import Optional

from sglang.srt.placement.topology import SNAPSHOT_FORMAT, SNAPSHOT_MARKER, _read
from sglang.srt.placement_tools import UsageError

logger = logging.getLogger(__name__)

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def capture_sysfs(dest: str | os.PathLike, *, root: str | os.PathLike = "/sys") -> int:
    """Copy the files ``read_topology(root)`` reads, and a marker, into ``dest``; return
    how many. Created through descriptors of ``dest`` only, so a link planted meanwhile
    is refused, not followed; on failure, what was created is removed."""
    out = _Destination(os.path.abspath(os.fspath(dest)))
    try:
        out.open()
        read = _read(root, setting="--sysfs-root")
        now = datetime.datetime.now(datetime.timezone.utc)
        marker = {
            "format": SNAPSHOT_FORMAT,
            "kernel_release": os.uname().release,
            "captured_at": now.isoformat(timespec="seconds"),
            "source_root": read.topology.root,
        }
        marker_text = json.dumps(marker, indent=2, sort_keys=True) + "\n"
        for rel, text in sorted({**read.files, SNAPSHOT_MARKER: marker_text}.items()):
            out.write_new(rel, text)
    except BaseException as exc:
        out.remove_created()
        if isinstance(exc, OSError):
            raise UsageError(
                f"{out.path}: cannot write the snapshot ({exc.strerror or exc}); "
                "nothing was left behind"
            ) from None
        raise
    finally:
        out.close()
    return len(read.files)


class _Destination:
    """The snapshot directory, held open; all below it is made through descriptors."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: dict[str, int] = {}  # by relative directory; "" is the destination
        self.created: list[tuple[str, bool]] = []  # (relative path, is a directory)
        self.parent_fd: Optional[int] = None
        self.created_top = False

    def open(self) -> None:
        parent, name = os.path.split(self.path)
        fix = "choose a new directory for the snapshot"
        try:
            # The parent may be reached through links (the user named it); dest not.
            self.parent_fd = os.open(parent, _OPEN_DIR & ~os.O_NOFOLLOW)
        except OSError:
            raise UsageError(
                f"{self.path}: its parent {parent} does not exist or is not a "
                "directory; create it first or choose another place"
            ) from None
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode=0o755, dir_fd=self.parent_fd)
                self.created_top = True
            self.fds[""] = fd = os.open(name, _OPEN_DIR, dir_fd=self.parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UsageError(f"{self.path}: exists and is not a directory; {fix}")
            raise UsageError(f"{self.path}: cannot be used ({exc.strerror}); {fix}")
        # Created here or not, it must be this user's alone: into a directory that
        # another user owns or may write to, links could be planted meanwhile.
        st, uid, why = os.fstat(fd), os.geteuid(), ""
        if st.st_uid != uid:
            why = f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
        elif stat.S_IMODE(st.st_mode) & 0o022:
            why = f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
        if why:
            mine = "a capture writes only into a directory of its own"
            raise UsageError(f"{self.path}: {why}; {mine}: {fix}")
        if not self.created_top and os.listdir(fd):
            raise UsageError(
                f"{self.path}: is not empty; choose a new or empty directory for the "
                "snapshot (a capture never overwrites files)"
            )

    def _dir_fd(self, rel_dir: str) -> int:
        """The descriptor of ``rel_dir``, created (with those above it) if need be."""
        if rel_dir not in self.fds:
            parent_rel, name = posixpath.split(rel_dir)
            parent_fd = self._dir_fd(parent_rel)
            # Made for an earlier file, it is opened below without following a link;
            # os.makedirs would give intermediate directories the umask's mode.
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode=0o755, dir_fd=parent_fd)
                self.created.append((rel_dir, True))
            self.fds[rel_dir] = os.open(name, _OPEN_DIR, dir_fd=parent_fd)
        return self.fds[rel_dir]

    def write_new(self, rel: str, text: str) -> None:
        """Create ``rel`` holding ``text`` (O_EXCL: never follows or overwrites)."""
        parent_rel, name = posixpath.split(rel)
        fd = os.open(name, _CREATE_FILE, 0o644, dir_fd=self._dir_fd(parent_rel))
        self.created.append((rel, False))
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("ascii", errors="replace"))

    def remove_created(self) -> None:
        for rel, is_dir in reversed(self.created):
            parent_rel, name = posixpath.split(rel)
            if rel in self.fds:
                os.close(self.fds.pop(rel))
            try:
                (os.rmdir if is_dir else os.unlink)(name, dir_fd=self.fds[parent_rel])
            except OSError:
                logger.warning(
                    f"Could not remove {posixpath.join(self.path, parent_rel, name)}"
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
        for fd in [*self.fds.values(), self.parent_fd]:
            if fd is not None:
                os.close(fd)
        self.fds.clear()
        self.parent_fd = None
