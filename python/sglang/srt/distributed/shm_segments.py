"""Who owns each ``/dev/shm`` segment of a :class:`ShmNamespace`: owner records, the sweep of dead owners' segments, release at exit.

Owner records
    The kernel's segments carry no owner pid, so each rank keeps a lock file,
    ``<segment>.owner`` (mode 0600), and holds an exclusive ``flock`` on it for as
    long as it lives. The kernel drops that lock when the process dies, however it
    dies, and ``flock`` works across pid namespaces that share ``/dev/shm``: a
    record that someone else can lock proves its owner dead, and the sweep removes
    that owner's segment and record. A segment whose record is locked is live and
    never touched; one with no record (made by code that keeps none) is reported
    and left alone.

Where the records live
    ``/dev/shm`` is writable by everyone and sticky: any name in it can be taken
    first by another user, and only the taker can remove it again. Records live
    only in *trusted* directories, ``sglang_shm_owners_<uid>`` or
    ``sglang_shm_owners_<uid>.<random>`` in ``shm_dir``: real directories (opened
    with ``O_NOFOLLOW`` and checked on the descriptor) of this uid with no group or
    other permissions, which no other user can make, rename, remove or write into.
    A rank records in ``sglang_shm_owners_<uid>`` when it is trusted or can be made;
    when something else holds that name (another user's directory, a file, a
    symlink, a directory with a group/other mode), it warns, naming the entry and
    its owner, and uses the first trusted ``.<random>`` one, made with ``mkdtemp``
    when there is none.

    Processes of one uid find each other's records by listing every trusted
    directory, so they need not agree on one: a claim locks its own record, then
    the same segment's record in every other trusted directory, repeating until a
    pass finds no record it does not hold. A lock it cannot take is a live owner
    (it backs off and retries); the records it took are dead and are removed. The
    sweep does the same per segment and unlinks the segment before any record, so
    a claimant that finds a record gone knows the segment is gone too. Directories
    are removed once empty.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
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
    busy_owner_error,
    explained_shm_errors,
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


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


# ------------------------------------------------------------- trusted directories


@dataclasses.dataclass(frozen=True)
class _Dir:
    path: str
    fd: int


def _open_trusted(path: str) -> Optional[_Dir]:
    """``path`` opened, if it is a trusted directory (see the module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    info = os.fstat(fd)  # a real directory: O_DIRECTORY and O_NOFOLLOW say so
    if info.st_uid == os.geteuid() and not info.st_mode & 0o077:
        return _Dir(path, fd)
    os.close(fd)
    return None


def _candidate_paths(shm_dir: str, uid: int) -> list[str]:
    """The usual owner directory first, then the private ones, sorted."""
    base = f"{_OWNER_DIR_PREFIX}_{uid}"
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    found = sorted(n for n in names if n == base or n.startswith(base + "."))
    return [os.path.join(shm_dir, name) for name in found]


@contextlib.contextmanager
def _trusted_dirs(shm_dir: str, uid: int) -> Iterator[list[_Dir]]:
    opened: list[_Dir] = []
    try:
        for path in _candidate_paths(shm_dir, uid):
            directory = _open_trusted(path)
            if directory is not None:
                opened.append(directory)
        yield opened
    finally:
        for directory in opened:
            os.close(directory.fd)


def _warn_untrusted(path: str, info: os.stat_result, private: str) -> None:
    key = (path, info.st_uid, info.st_mode)
    if key in _WARNED:
        return
    _WARNED.add(key)
    kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a file"
    kind = "a symlink" if stat.S_ISLNK(info.st_mode) else kind
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
    usual = os.path.join(shm_dir, f"{_OWNER_DIR_PREFIX}_{uid}")
    while True:
        with contextlib.suppress(FileExistsError):
            os.mkdir(usual, 0o700)
        home = _open_trusted(usual)
        if home is not None:
            return home
        try:
            found = os.lstat(usual)
        except FileNotFoundError:
            # Removed as empty by a releasing rank since our mkdir: make it again.
            continue
        paths = (p for p in _candidate_paths(shm_dir, uid) if p != usual)
        private = next(filter(None, map(_open_trusted, paths)), None)
        if private is None:
            prefix = os.path.basename(usual) + "."
            private = _open_trusted(tempfile.mkdtemp(prefix=prefix, dir=shm_dir))
            if private is None:
                continue
        _warn_untrusted(usual, found, private.path)
        return private


# --------------------------------------------------------------------------- owner records


def _same_file(fd: int, path: str, dir_fd: Optional[int] = None) -> bool:
    try:
        on_disk = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return _identity(on_disk) == _identity(os.fstat(fd))


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
        try:
            pid = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
        except OSError:
            pid = "?"
        os.close(fd)
        pid = pid if pid.isascii() and pid.isdigit() else "?"
        return None, BusyRecord(path, info.st_dev, info.st_ino, pid)
    record = _Held(path, fd)
    if not _same_file(fd, name, directory.fd):
        record.close(unlink=False)
        return None, None
    return record, None


def _lock_records(
    segment: str, shm_dir: str, uid: int, *, own: Optional[int] = None
) -> tuple[Optional[list[_Held]], Optional[BusyRecord]]:
    """Lock the record of ``segment`` in every trusted directory (all but ``own``'s
    file), in passes until one finds no record it does not hold.

    ``(records, None)``: every one dead and now held here. ``(None, busy)``: someone
    else holds one (``busy`` None: records kept coming and going); none stays locked.
    """
    name = segment + OWNER_RECORD_SUFFIX
    skip = set() if own is None else {_identity(os.fstat(own))}
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
                    if _identity(info) in skip:
                        continue
                    fresh = True
                    record, busy = _lock_at(directory, name, create=False)
                    if busy is not None:
                        _close_all(held, unlink=False)
                        return None, busy
                    if record is not None:
                        held.append(record)
                        skip.add(_identity(os.fstat(record.fd)))
            if not fresh:
                return held, None
    except BaseException:
        _close_all(held, unlink=False)
        raise
    _close_all(held, unlink=False)
    return None, None


def _claim_owner(
    namespace: ShmNamespace, rank: int, *, shm_dir: str, wait_s: float
) -> tuple[_Held, list[_Held]]:
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
                    try:
                        os.ftruncate(own.fd, 0)
                        os.pwrite(own.fd, f"{os.getpid()}\n".encode(), 0)
                    except OSError as exc:
                        raise OSError(exc.errno, exc.strerror, own.path) from None
                    return own, others
            except BaseException:
                own.close(unlink=True)
                raise
            own.close(unlink=True)
        elif busy is None:
            # The directory was removed as empty, or the record replaced, meanwhile.
            continue
        if time.monotonic() >= deadline:
            raise busy_owner_error(namespace, rank, busy)
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


def _recorded_segments(shm_dir: str, uid: int) -> set[str]:
    """Every segment of ``uid`` with an owner record in a trusted directory."""
    head = f"{SHM_SEGMENT_PREFIX}_{uid}_"
    found: set[str] = set()
    with _trusted_dirs(shm_dir, uid) as dirs:
        for directory in dirs:
            for name in os.listdir(directory.fd):
                segment = name[: -len(OWNER_RECORD_SUFFIX)]
                rank = segment.rpartition("_")[2]
                if (
                    name.endswith(OWNER_RECORD_SUFFIX)
                    and segment.startswith(head)
                    and rank.isascii()
                    and rank.isdigit()
                ):
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


def remove_stale_segments(
    namespace: ShmNamespace, *, shm_dir: str = SHM_DIR, skip_rank: Optional[int] = None
) -> StaleSweep:
    """Remove every segment (and owner record) of ``namespace.uid`` whose owner is gone,
    whatever its namespace.

    Never touches a segment whose owner lives, or one without an owner record.
    ``removed`` lists every segment removed; ``live`` and ``unknown`` (segments
    without a record) speak of ``namespace`` only, less ``skip_rank``.
    """
    skip = None if skip_rank is None else namespace.segment_name(skip_rank)
    removed: list[str] = []
    live: list[str] = []
    for segment in sorted(_recorded_segments(shm_dir, namespace.uid) - {skip}):
        held, _busy = _lock_records(segment, shm_dir, namespace.uid)
        if held is None:
            if namespace.rank_of(segment) is not None:
                live.append(segment)
            continue
        try:
            # The segment goes first: whoever finds a record gone knows its segment is
            # gone.
            if held and _unlink_segment(os.path.join(shm_dir, segment)):
                removed.append(segment)
        finally:
            _close_all(held, unlink=True)
    unknown = _unrecorded(namespace, shm_dir, skip)
    for name in removed:
        logger.info(f"Removed stale shared-memory segment {name}: its owner is gone")
    if unknown:
        logger.warning(
            f"Shared-memory segments {', '.join(unknown)} in {shm_dir!r} have no owner "
            f"record, so whether they are in use is unknown; they are left alone. If no "
            f"engine on {namespace.describe()} runs, remove them by hand"
        )
    return StaleSweep(tuple(removed), tuple(live), tuple(unknown))


# ------------------------------------------------------------------------ claim and release


# What this process owns, with the pid that claimed it: a forked child inherits the
# records but is not their owner, and must not release them.
_OWNED: dict[tuple[ShmNamespace, int, str], tuple[_Held, int]] = {}
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
            owned_ns, owned_rank, shm_dir = key
            if namespace in (None, owned_ns) and rank in (None, owned_rank):
                held, pid = _OWNED.pop(key)
                segment = owned_ns.segment_name(owned_rank)
                if pid == os.getpid():
                    _unlink_segment(os.path.join(shm_dir, segment))
                    held.close(unlink=True)
                released.append(segment)
    return released


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
    global _ATEXIT_REGISTERED
    key = (namespace, rank, shm_dir)
    with _OWNED_LOCK:
        if key in _OWNED:
            return
    with explained_shm_errors(namespace=namespace, rank=rank, shm_dir=shm_dir):
        own, dead = _claim_owner(namespace, rank, shm_dir=shm_dir, wait_s=wait_s)
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
        own.close(unlink=True)
        raise
    with _OWNED_LOCK:
        _OWNED[key] = (own, os.getpid())
        if not _ATEXIT_REGISTERED:
            atexit.register(release_shm_collective)
            _ATEXIT_REGISTERED = True
