"""Who owns each ``/dev/shm`` segment of a :class:`ShmNamespace`: owner records, the stale-segment sweep, release at exit.

The kernel's segments carry no owner pid, so each rank keeps a lock file,
``<shm_dir>/sglang_shm_owners_<uid>/<segment>.owner`` (directory 0700, file
0600), and holds an exclusive ``flock`` on it for as long as it lives. The
kernel drops that lock when the process dies, however it dies, and ``flock``
works across pid namespaces that share ``/dev/shm``. A segment whose record can
be locked by someone else has no live owner and is removed; one whose record is
locked is live and never touched; one with no record at all (made by code that
keeps none) is reported and left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import logging
import os
import stat
import threading
import time
from typing import Optional

from sglang.srt.distributed.shm_namespace import ShmNamespace

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_OWNER_DIR_PREFIX = "sglang_shm_owners"
_OWNER_SUFFIX = ".owner"


class ShmOwnerError(RuntimeError):
    """A segment's owner record cannot be created or is held by a live process."""


# ------------------------------------------------------------------------- owner records


def _owner_dir(shm_dir: str, uid: int) -> str:
    return os.path.join(shm_dir, f"{_OWNER_DIR_PREFIX}_{uid}")


def _ensure_owner_dir(shm_dir: str, uid: int) -> str:
    path = _owner_dir(shm_dir, uid)
    while True:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        try:
            info = os.lstat(path)
            break
        except FileNotFoundError:
            # Removed as empty by a releasing rank since our mkdir: make it again.
            continue
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ShmOwnerError(
            f"{path} must be a directory owned by uid {os.geteuid()} with mode 0700 "
            f"(found mode {stat.filemode(info.st_mode)}, uid {info.st_uid}); remove it and restart"
        )
    return path


def _owner_path(namespace: ShmNamespace, rank: int, shm_dir: str) -> str:
    return os.path.join(
        _owner_dir(shm_dir, namespace.uid), namespace.segment_name(rank) + _OWNER_SUFFIX
    )


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _same_file(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


@dataclasses.dataclass
class _OwnerRecord:
    namespace: ShmNamespace
    rank: int
    shm_dir: str
    path: str
    fd: int
    pid: int

    def release(self, *, unlink_segment: bool) -> None:
        if self.fd < 0 or self.pid != os.getpid():
            return
        if unlink_segment:
            _unlink_quiet(os.path.join(self.shm_dir, self.namespace.segment_name(self.rank)))
        # Unlinked while still locked: anyone who opened the old file re-checks the
        # path after locking and starts over on a fresh file.
        if _same_file(self.fd, self.path):
            _unlink_quiet(self.path)
        os.close(self.fd)
        self.fd = -1
        # Leave no empty directory behind; a claim racing with this re-creates it.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _claim_owner(
    namespace: ShmNamespace, rank: int, *, shm_dir: str, wait_s: float
) -> _OwnerRecord:
    """Lock this rank's owner record, waiting up to ``wait_s`` for a short-lived holder."""
    path = _owner_path(namespace, rank, shm_dir)
    deadline = time.monotonic() + wait_s
    while True:
        _ensure_owner_dir(shm_dir, namespace.uid)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            # The directory was removed as empty between the check and the open.
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise ShmOwnerError(
                    f"rank {rank}: segment {namespace.segment_name(rank)} belongs to a live "
                    f"process (pid {holder}); another engine uses the same address "
                    f"{namespace.addr}:{namespace.port}. Give each engine its own "
                    f"--dist-init-addr or port"
                ) from None
            time.sleep(0.05)
            continue
        if not _same_file(fd, path):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return _OwnerRecord(namespace, rank, shm_dir, path, fd, os.getpid())


@dataclasses.dataclass(frozen=True)
class StaleSweep:
    """What :func:`remove_stale_segments` found, as segment names."""

    removed: tuple[str, ...] = ()
    live: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def _namespace_ranks(namespace: ShmNamespace, shm_dir: str) -> tuple[set[int], set[int]]:
    """Ranks with a segment, and ranks with an owner record, in this namespace."""
    segments: set[int] = set()
    records: set[int] = set()
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            rank = namespace.rank_of(name)
            if rank is not None:
                segments.add(rank)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(_owner_dir(shm_dir, namespace.uid)):
            if name.endswith(_OWNER_SUFFIX):
                rank = namespace.rank_of(name[: -len(_OWNER_SUFFIX)])
                if rank is not None:
                    records.add(rank)
    return segments, records


def _probe_and_remove(namespace: ShmNamespace, rank: int, shm_dir: str) -> Optional[bool]:
    """True if the owner was gone and the rank's files were removed, False if the owner
    lives, None if there is no owner record."""
    path = _owner_path(namespace, rank, shm_dir)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not _same_file(fd, path):
            # Replaced since we opened it: whoever replaced it decides.
            return False
        _unlink_quiet(os.path.join(shm_dir, namespace.segment_name(rank)))
        _unlink_quiet(path)
        return True
    finally:
        os.close(fd)


def remove_stale_segments(
    namespace: ShmNamespace, *, shm_dir: str = SHM_DIR, skip_rank: Optional[int] = None
) -> StaleSweep:
    """Remove this namespace's segments (and owner records) whose owners are gone.

    Never touches another namespace, a segment whose owner lives, or a segment
    without an owner record (reported in ``unknown``).
    """
    segments, records = _namespace_ranks(namespace, shm_dir)
    removed: list[str] = []
    live: list[str] = []
    unknown: list[str] = []
    for rank in sorted(segments | records):
        if rank == skip_rank:
            continue
        name = namespace.segment_name(rank)
        outcome = _probe_and_remove(namespace, rank, shm_dir)
        if outcome is None:
            if rank in segments:
                unknown.append(name)
        elif outcome:
            if rank in segments:
                removed.append(name)
        else:
            live.append(name)
    for name in removed:
        logger.info(f"Removed stale shared-memory segment {name}: its owner is gone")
    if unknown:
        logger.warning(
            f"Shared-memory segments {', '.join(unknown)} in {shm_dir} have no owner record, "
            f"so whether they are in use is unknown; they are left alone. If no engine on "
            f"{namespace.addr}:{namespace.port} runs, remove them by hand"
        )
    return StaleSweep(tuple(removed), tuple(live), tuple(unknown))


_OWNED: dict[tuple[ShmNamespace, int, str], _OwnerRecord] = {}
_OWNED_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def release_shm_collective(
    namespace: Optional[ShmNamespace] = None, *, rank: Optional[int] = None
) -> list[str]:
    """Unlink this process's segments (all, or those of ``namespace``/``rank``) and drop
    their owner records. Runs at interpreter exit; peers that still map a segment keep
    their mapping. Returns the segment names released."""
    released: list[str] = []
    with _OWNED_LOCK:
        for key in list(_OWNED):
            ns, owned_rank, _dir = key
            if namespace is not None and ns != namespace:
                continue
            if rank is not None and owned_rank != rank:
                continue
            record = _OWNED.pop(key)
            record.release(unlink_segment=True)
            released.append(ns.segment_name(owned_rank))
    return released


def _remember(record: _OwnerRecord) -> None:
    global _ATEXIT_REGISTERED
    with _OWNED_LOCK:
        _OWNED[(record.namespace, record.rank, record.shm_dir)] = record
        if not _ATEXIT_REGISTERED:
            atexit.register(release_shm_collective)
            _ATEXIT_REGISTERED = True


def claim_segment(
    namespace: ShmNamespace, *, rank: int, shm_dir: str = SHM_DIR, wait_s: float = 10.0
) -> None:
    """Make this process the owner of ``rank``'s segment in ``namespace``, once per process.

    Locks the rank's owner record (waiting up to ``wait_s`` for a short-lived
    holder; :class:`ShmOwnerError` if a live process keeps it), removes the rank's
    own leftover segment and the namespace's segments whose owners are gone, and
    registers the segment for :func:`release_shm_collective` at exit.
    """
    key = (namespace, rank, shm_dir)
    with _OWNED_LOCK:
        record = _OWNED.get(key)
    if record is not None:
        return
    record = _claim_owner(namespace, rank, shm_dir=shm_dir, wait_s=wait_s)
    segment = namespace.segment_name(rank)
    try:
        # We hold the record, so any segment under our name is a dead owner's.
        if _unlink_quiet(os.path.join(shm_dir, segment)):
            logger.info(
                f"rank {rank}: removed stale shared-memory segment {segment} "
                f"left by a previous owner"
            )
        remove_stale_segments(namespace, shm_dir=shm_dir, skip_rank=rank)
    except BaseException:
        record.release(unlink_segment=False)
        raise
    _remember(record)


__all__ = [
    "SHM_DIR",
    "ShmOwnerError",
    "StaleSweep",
    "claim_segment",
    "release_shm_collective",
    "remove_stale_segments",
]
