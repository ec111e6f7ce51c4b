"""Who owns each ``/dev/shm`` segment of a :class:`ShmNamespace`: owner records, the sweep of dead owners' segments, release at exit.

Owner records
    The kernel's segments carry no owner pid, so each rank keeps a lock file,
    ``<segment>.owner`` (mode 0600), and holds an exclusive ``flock`` on it for as
    long as it lives. The kernel drops that lock when the process dies, however it
    dies, and ``flock`` works across pid namespaces that share ``/dev/shm``. A record
    that someone else can lock therefore proves its owner dead, whatever its
    namespace: the sweep removes that owner's segment and record. A segment whose
    record is locked is live and never touched; one with no record at all (made by
    code that keeps none) is reported and left alone.

Where the records live
    ``/dev/shm`` is writable by everyone and sticky: any name in it can be taken
    first by another user, and only the taker can remove it again. Records
    therefore live only in *trusted* directories: ``<shm_dir>/sglang_shm_owners_<uid>``
    or ``<shm_dir>/sglang_shm_owners_<uid>.<random>``, which ``lstat`` shows to be a
    real directory (not a symlink) owned by this uid with no group or other
    permissions. No other user can make, rename, remove or write into such a
    directory, and every directory is opened with ``O_NOFOLLOW`` and checked on its
    descriptor before a record is made in it. A rank makes its record in
    ``sglang_shm_owners_<uid>`` when that is trusted or can be made; when something
    else holds the name (another user's directory, a file, a symlink, or a
    directory with a group/other mode), it warns, naming that entry and its owner,
    and uses the first trusted ``sglang_shm_owners_<uid>.<random>`` instead,
    making one with ``mkdtemp`` when there is none.

    Processes of one uid find each other's records by listing every trusted
    directory, so they need not agree on one: a claim locks its own record, then
    locks the record of the same segment in every other trusted directory,
    repeating until a pass finds no record it does not hold. A lock it cannot take
    is a live owner (it backs off and retries); the records it took are dead and
    are removed. The sweep does the same per segment and unlinks the segment before
    any record, so a later claimant that finds a record gone knows the segment is
    gone too. Directories are removed once empty.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import random
import stat
import tempfile
import threading
import time
from typing import Iterator, Optional

from sglang.srt.distributed.shm_errors import (
    SHM_DIR,
    BusyRecord,
    ShmCollectiveError,
    describe_busy_owner,
    explained_shm_errors,
    find_lock_holders,
    pid_alive,
)
from sglang.srt.distributed.shm_namespace import (
    OWNER_RECORD_SUFFIX,
    SHM_SEGMENT_PREFIX,
    ShmNamespace,
)

logger = logging.getLogger(__name__)

_OWNER_DIR_PREFIX = "sglang_shm_owners"
# A pass that keeps finding new records means claimants keep coming and going;
# after this many the segment counts as busy and the caller retries later.
_MAX_PASSES = 50
_WARNED: set[tuple[str, int, int]] = set()


# --------------------------------------------------------------------- trusted directories


def _owner_dir(shm_dir: str, uid: int) -> str:
    return os.path.join(shm_dir, f"{_OWNER_DIR_PREFIX}_{uid}")


def _is_trusted(info: os.stat_result) -> bool:
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & 0o077
    )


def _open_trusted(path: str) -> Optional[int]:
    """A descriptor of ``path`` if it is a trusted directory, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if _is_trusted(os.fstat(fd)):
        return fd
    os.close(fd)
    return None


def _candidate_names(shm_dir: str, uid: int) -> list[str]:
    """The usual owner directory's name first, then the private ones, sorted."""
    base = os.path.basename(_owner_dir(shm_dir, uid))
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n == base or n.startswith(base + "."))


@dataclasses.dataclass(frozen=True)
class _Dir:
    path: str
    fd: int


@contextlib.contextmanager
def _trusted_dirs(shm_dir: str, uid: int) -> Iterator[list[_Dir]]:
    opened: list[_Dir] = []
    try:
        for name in _candidate_names(shm_dir, uid):
            path = os.path.join(shm_dir, name)
            fd = _open_trusted(path)
            if fd is not None:
                opened.append(_Dir(path, fd))
        yield opened
    finally:
        for directory in opened:
            os.close(directory.fd)


def _warn_untrusted(path: str, info: os.stat_result, private: str) -> None:
    key = (path, info.st_uid, info.st_mode)
    if key in _WARNED:
        return
    _WARNED.add(key)
    kind = (
        "a symlink"
        if stat.S_ISLNK(info.st_mode)
        else ("a directory" if stat.S_ISDIR(info.st_mode) else "a file")
    )
    if info.st_uid == os.geteuid():
        why, who = "its mode lets other users in", "remove"
    else:
        why = "another user may have made it to block this user's engines"
        who = f"have uid {info.st_uid} (or root) remove"
    logger.warning(
        f"{path!r} is {kind} owned by uid {info.st_uid} with mode "
        f"{stat.filemode(info.st_mode)}, not a private directory of uid {os.geteuid()}: "
        f"{why}. Owner records go to {private!r} instead; to use the usual place "
        f"again, {who} {path!r}"
    )


def _home_dir(shm_dir: str, uid: int) -> _Dir:
    """The trusted directory this process makes its records in (see the module docstring)."""
    usual = _owner_dir(shm_dir, uid)
    while True:
        with contextlib.suppress(FileExistsError):
            os.mkdir(usual, 0o700)
        fd = _open_trusted(usual)
        if fd is not None:
            return _Dir(usual, fd)
        try:
            found = os.lstat(usual)
        except FileNotFoundError:
            # Removed as empty by a releasing rank since our mkdir: make it again.
            continue
        private = None
        for name in _candidate_names(shm_dir, uid):
            path = os.path.join(shm_dir, name)
            if path != usual:
                fd = _open_trusted(path)
                if fd is not None:
                    private = _Dir(path, fd)
                    break
        if private is None:
            path = tempfile.mkdtemp(prefix=os.path.basename(usual) + ".", dir=shm_dir)
            fd = _open_trusted(path)
            if fd is None:
                continue
            private = _Dir(path, fd)
        _warn_untrusted(usual, found, private.path)
        return private


# --------------------------------------------------------------------------- owner records


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return "?"
    return text if text.isascii() and text.isdigit() else "?"


def _same_file(fd: int, path: str, dir_fd: Optional[int] = None) -> bool:
    try:
        on_disk = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _foreign_owner(path: str) -> Optional[int]:
    """The uid owning ``path`` if it exists and is not this process's, else None."""
    try:
        owner = os.lstat(path).st_uid
    except FileNotFoundError:
        return None
    return owner if owner != os.geteuid() else None


def _unlink_segment(path: str) -> bool:
    """Unlink our own segment at ``path``; a file of another user is left alone (we
    could remove it only as root, and it is not ours to remove)."""
    owner = _foreign_owner(path)
    if owner is not None:
        logger.warning(
            f"{path!r} is owned by uid {owner}, not {os.geteuid()}; it is left alone"
        )
        return False
    return _unlink_quiet(path)


@dataclasses.dataclass
class _Held:
    """A record locked by this process (``fd``) at ``path``."""

    path: str
    fd: int

    def close(self, *, unlink: bool) -> None:
        if self.fd < 0:
            return
        # Unlinked while still locked: anyone who opened the old file re-checks the
        # path after locking and starts over on a fresh file.
        if unlink and _same_file(self.fd, self.path):
            _unlink_quiet(self.path)
        os.close(self.fd)
        self.fd = -1
        if unlink:
            # Leave no empty directory behind; a claim racing with this re-creates it.
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))


def _close_all(held: list[_Held], *, unlink: bool) -> None:
    for record in held:
        record.close(unlink=unlink)


def _lock_at(
    directory: _Dir, name: str, *, create: bool
) -> tuple[Optional[_Held], Optional[BusyRecord]]:
    """Open and lock the record ``name`` in ``directory``.

    ``(record, None)`` once locked; ``(None, busy)`` when someone else holds it;
    ``(None, None)`` when it vanished or was replaced meanwhile (look again).
    """
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    path = os.path.join(directory.path, name)
    try:
        fd = os.open(name, flags, 0o600, dir_fd=directory.fd)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        # Opened relative to a directory descriptor: the error names no file.
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        info = os.fstat(fd)
        busy = BusyRecord(path, info.st_dev, info.st_ino, _read_pid(fd))
        os.close(fd)
        return None, busy
    record = _Held(path, fd)
    if not _same_file(fd, name, directory.fd):
        record.close(unlink=False)
        return None, None
    return record, None


def _lock_records(
    segment: str, shm_dir: str, uid: int, *, own: Optional[int] = None
) -> tuple[Optional[list[_Held]], Optional[BusyRecord]]:
    """Lock the record of ``segment`` in every trusted directory (all but ``own``'s file).

    Returns ``(records, None)``, every one dead and now held here, or
    ``(None, busy)`` when someone else holds one (nothing then stays locked;
    ``busy`` is None when records kept coming and going). Passes repeat with a
    fresh listing until one finds no record it does not hold, so a directory or
    record made meanwhile is not missed.
    """
    name = segment + OWNER_RECORD_SUFFIX
    skip = set()
    if own is not None:
        info = os.fstat(own)
        skip.add((info.st_dev, info.st_ino))
    held: list[_Held] = []
    try:
        for _ in range(_MAX_PASSES):
            fresh = False
            with _trusted_dirs(shm_dir, uid) as dirs:
                for directory in dirs:
                    try:
                        info = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if (info.st_dev, info.st_ino) in skip:
                        continue
                    fresh = True
                    record, busy = _lock_at(directory, name, create=False)
                    if busy is not None:
                        _close_all(held, unlink=False)
                        return None, busy
                    if record is not None:
                        held.append(record)
                        info = os.fstat(record.fd)
                        skip.add((info.st_dev, info.st_ino))
            if not fresh:
                return held, None
    except BaseException:
        _close_all(held, unlink=False)
        raise
    _close_all(held, unlink=False)
    return None, None


@dataclasses.dataclass
class _OwnerRecord:
    namespace: ShmNamespace
    rank: int
    shm_dir: str
    held: _Held
    pid: int

    def release(self, *, unlink_segment: bool) -> None:
        if self.held.fd < 0 or self.pid != os.getpid():
            return
        if unlink_segment:
            segment = self.namespace.segment_name(self.rank)
            _unlink_segment(os.path.join(self.shm_dir, segment))
        self.held.close(unlink=True)


def _live_owner_error(
    namespace: ShmNamespace, rank: int, busy: Optional[BusyRecord]
) -> ShmCollectiveError:
    holders = [] if busy is None else find_lock_holders(dev=busy.dev, ino=busy.ino)
    return ShmCollectiveError(
        describe_busy_owner(
            rank=rank,
            segment=namespace.segment_name(rank),
            address=namespace.describe(),
            busy=busy,
            holders=holders,
            recorded_alive=busy is not None and pid_alive(busy.recorded_pid),
        )
    )


def _write_pid(record: _Held) -> None:
    try:
        os.ftruncate(record.fd, 0)
        os.pwrite(record.fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, record.path) from None


def _claim_owner(
    namespace: ShmNamespace, rank: int, *, shm_dir: str, wait_s: float
) -> tuple[_OwnerRecord, list[_Held]]:
    """Lock this rank's owner record, waiting up to ``wait_s`` for a short-lived holder.

    Also returns the segment's dead records found in other directories, locked.
    """
    segment = namespace.segment_name(rank)
    name = segment + OWNER_RECORD_SUFFIX
    deadline = time.monotonic() + wait_s
    while True:
        home = _home_dir(shm_dir, namespace.uid)
        try:
            own, busy = _lock_at(home, name, create=True)
        finally:
            os.close(home.fd)
        if own is not None:
            try:
                others, busy = _lock_records(
                    segment, shm_dir, namespace.uid, own=own.fd
                )
                if others is not None:
                    _write_pid(own)
                    record = _OwnerRecord(namespace, rank, shm_dir, own, os.getpid())
                    return record, others
            except BaseException:
                own.close(unlink=True)
                raise
            own.close(unlink=True)
        elif busy is None:
            # The directory was removed as empty, or the record replaced, meanwhile.
            continue
        if time.monotonic() >= deadline:
            raise _live_owner_error(namespace, rank, busy)
        # Two claimants in different directories both back off: a random pause
        # lets one of them win the next round.
        time.sleep(random.uniform(0.02, 0.08))


# ------------------------------------------------------------------------------ the sweep


@dataclasses.dataclass(frozen=True)
class StaleSweep:
    """What :func:`remove_stale_segments` found, as segment names."""

    removed: tuple[str, ...] = ()
    live: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def _is_segment_of(name: str, uid: int) -> bool:
    head = f"{SHM_SEGMENT_PREFIX}_{uid}_"
    rank = name.rpartition("_")[2]
    return name.startswith(head) and rank.isascii() and rank.isdigit()


def _recorded_segments(shm_dir: str, uid: int) -> set[str]:
    """Every segment of ``uid`` with an owner record in a trusted directory."""
    found: set[str] = set()
    with _trusted_dirs(shm_dir, uid) as dirs:
        for directory in dirs:
            for name in os.listdir(directory.fd):
                segment = name[: -len(OWNER_RECORD_SUFFIX)]
                if name.endswith(OWNER_RECORD_SUFFIX) and _is_segment_of(segment, uid):
                    found.add(segment)
    return found


def _unrecorded(
    namespace: ShmNamespace, shm_dir: str, skip: Optional[str]
) -> list[str]:
    """Segments of ``namespace`` that have no owner record.

    A record is made before its segment and removed after it, so a segment file
    seen both before and after a listing of the records, and absent from it, has
    none; one claimed or released meanwhile is not reported.
    """

    def inode(name: str) -> Optional[int]:
        try:
            return os.lstat(os.path.join(shm_dir, name)).st_ino
        except FileNotFoundError:
            return None

    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    before = {
        n: inode(n) for n in names if namespace.rank_of(n) is not None and n != skip
    }
    recorded = _recorded_segments(shm_dir, namespace.uid)
    return sorted(
        n
        for n, ino in before.items()
        if ino is not None and n not in recorded and inode(n) == ino
    )


def _remove_if_dead(segment: str, shm_dir: str, uid: int) -> Optional[bool]:
    """True if the segment's owners were all dead and the segment is removed, False if
    one lives, None if there was no segment of ours to remove (dead records are)."""
    held, _holder = _lock_records(segment, shm_dir, uid)
    if held is None:
        return False
    try:
        # The segment goes first: whoever finds a record gone knows its segment is gone.
        return (bool(held) and _unlink_segment(os.path.join(shm_dir, segment))) or None
    finally:
        _close_all(held, unlink=True)


def remove_stale_segments(
    namespace: ShmNamespace, *, shm_dir: str = SHM_DIR, skip_rank: Optional[int] = None
) -> StaleSweep:
    """Remove every segment (and owner record) of ``namespace.uid`` whose owner is gone,
    whatever its namespace.

    Never touches a segment whose owner lives, or one without an owner record.
    ``removed`` lists every segment removed; ``live`` and ``unknown`` (segments
    without a record) speak of ``namespace`` only, less ``skip_rank``.
    """
    uid = namespace.uid
    skip = None if skip_rank is None else namespace.segment_name(skip_rank)
    recorded = _recorded_segments(shm_dir, uid)
    removed: list[str] = []
    live: list[str] = []
    for segment in sorted(recorded - {skip}):
        outcome = _remove_if_dead(segment, shm_dir, uid)
        if outcome:
            removed.append(segment)
        elif outcome is False and namespace.rank_of(segment) is not None:
            live.append(segment)
    unknown = _unrecorded(namespace, shm_dir, skip)
    for name in removed:
        logger.info(f"Removed stale shared-memory segment {name}: its owner is gone")
    if unknown:
        logger.warning(
            f"Shared-memory segments {', '.join(unknown)} in {shm_dir!r} have no owner "
            f"record, so whether they are in use is unknown; they are left alone. If no "
            f"engine on {namespace.describe()} runs, "
            f"remove them by hand"
        )
    return StaleSweep(tuple(removed), tuple(live), tuple(unknown))


# ------------------------------------------------------------------------ claim and release


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


# ------------------------------------------------------------------------ claiming


def claim_segment(
    namespace: ShmNamespace, *, rank: int, shm_dir: str = SHM_DIR, wait_s: float = 10.0
) -> None:
    """Make this process the owner of ``rank``'s segment in ``namespace``, once per process.

    Locks the rank's owner record (waiting up to ``wait_s`` for a short-lived
    holder), removes the rank's own leftover segment and every segment of this uid
    whose owner is gone, and registers the segment for
    :func:`release_shm_collective` at exit. :class:`ShmCollectiveError` when a live
    process (or one that inherited a dead owner's lock) keeps the record, when
    another user made a file under the segment's name, or when ``shm_dir`` is full
    or read-only.
    """
    key = (namespace, rank, shm_dir)
    with _OWNED_LOCK:
        record = _OWNED.get(key)
    if record is not None:
        return
    with explained_shm_errors(namespace=namespace, rank=rank, shm_dir=shm_dir):
        record, dead = _claim_owner(namespace, rank, shm_dir=shm_dir, wait_s=wait_s)
    segment = namespace.segment_name(rank)
    path = os.path.join(shm_dir, segment)
    try:
        try:
            planter = _foreign_owner(path)
            if planter is not None:
                raise ShmCollectiveError(
                    f"rank {rank}: {path!r} is owned by uid {planter}, not by this "
                    f"process's uid {os.geteuid()}: another user made a file under "
                    f"this engine's segment name, which the CPU kernel would fail to "
                    f"open or would share with that user. Have uid {planter} (or "
                    f"root) remove it, or give this engine another --dist-init-addr "
                    f"or port"
                )
            # We hold every record of the segment, so any segment under our name is a
            # dead owner's.
            if _unlink_quiet(path):
                logger.info(
                    f"rank {rank}: removed stale shared-memory segment {segment} "
                    f"left by a previous owner"
                )
        finally:
            _close_all(dead, unlink=True)
        remove_stale_segments(namespace, shm_dir=shm_dir, skip_rank=rank)
    except BaseException:
        record.release(unlink_segment=False)
        raise
    _remember(record)


__all__ = [
    "StaleSweep",
    "claim_segment",
    "release_shm_collective",
    "remove_stale_segments",
]
