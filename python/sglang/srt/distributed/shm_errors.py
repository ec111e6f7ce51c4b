"""Why a CPU collective's ``/dev/shm`` segment cannot be made, in words an operator can act on.

A full ``/dev/shm`` (the bytes needed and how to grow it), a read-only one, and
an owner record that is still locked: by a live engine on the same address, or
by a process that inherited a dead engine's lock (named, with its command line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from typing import Iterator, Optional, Sequence

from sglang.srt.distributed.shm_namespace import ShmNamespace, quoted

SHM_DIR = "/dev/shm"
# sizeof(struct allreduce_workspace) in sgl-kernel's CPU shm.cpp: two int states,
# then a double buffer of NAIVE_ALLREDUCE_THRESHOLD (1 MiB) and one of MAX_BUF_SIZE
# (32 MiB). The kernel write()s this much into each rank's segment.
KERNEL_SEGMENT_BYTES = 2 * 4 + 2 * (1 << 20) + 2 * (32 << 20)
_MIB = 1 << 20


class ShmCollectiveError(RuntimeError):
    """The CPU shared-memory collective cannot be set up: its segment belongs to a live
    process or another user, /dev/shm is full or read-only, or the kernel op has a
    shape this package does not know."""


@dataclasses.dataclass(frozen=True)
class BusyRecord:
    """An owner record that another open file holds locked: the record's path and
    identity, and the pid written in it (the process that claimed it)."""

    path: str
    dev: int
    ino: int
    recorded_pid: str


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """A process with an open file that holds a flock on an owner record."""

    pid: int
    command: str


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _command_line(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return "?"
    return " ".join(w.decode("utf-8", "replace") for w in raw.split(b"\0") if w) or "?"


def _lock_holders(busy: BusyRecord) -> list[LockHolder]:
    """Every process whose open file of ``busy``'s record holds a flock on it.

    ``/proc/locks`` names the process that took a flock, which may be long dead
    when a child it forked inherited the open file (and with it the lock), so the
    open files themselves are read: ``/proc/<pid>/fd`` and ``fdinfo``. Processes
    this user may not inspect are passed over.
    """
    holders: list[LockHolder] = []
    pids = [p for p in _listdir("/proc") if p.isascii() and p.isdigit()]
    for pid in sorted(pids, key=int):
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                info = os.stat(f"/proc/{pid}/fd/{fd}")
                if (info.st_dev, info.st_ino) != (busy.dev, busy.ino):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    fdinfo = f.read(65536).splitlines()
            except OSError:
                continue
            # fdinfo lists, as "lock:" lines, the locks that this open file holds.
            if any(line.startswith("lock:") and " FLOCK " in line for line in fdinfo):
                holders.append(LockHolder(int(pid), _command_line(pid)))
                break
    return holders


def describe_busy_owner(
    *,
    rank: int,
    segment: str,
    address: str,
    busy: Optional[BusyRecord],
    holders: Sequence[LockHolder],
    recorded_alive: bool,
) -> str:
    """The message for a segment whose owner record someone else holds (pure).

    ``holders`` are the processes seen holding the record's lock;
    ``recorded_alive`` says whether the pid written in the record still runs.
    """
    fix = "Give each engine its own --dist-init-addr or port"
    if busy is None:
        return (
            f"rank {rank}: the owner records of segment {segment} kept changing "
            f"hands; another engine is starting on the same address {address}. {fix}"
        )
    recorded = busy.recorded_pid
    shown = ", ".join(f"pid {h.pid}: {quoted(h.command)}" for h in holders)
    # No pid written yet ("?"): the holder is a claimant in the middle of its claim.
    if any(str(h.pid) == recorded for h in holders) or (holders and recorded == "?"):
        return (
            f"rank {rank}: segment {segment} belongs to a live process ({shown}); "
            f"another engine uses the same address {address}. {fix}"
        )
    if holders:
        pids = " ".join(str(h.pid) for h in holders)
        return (
            f"rank {rank}: segment {segment} is still held: its owner record "
            f"{busy.path!r} was made by pid {recorded}, which no longer holds it, and "
            f"is locked by {shown}, a process that inherited the lock (one the engine "
            f"started before it died, for example). Stop that process (kill {pids}) "
            f"and start this engine again, or give it its own --dist-init-addr or port"
        )
    # Nobody seen: the holder runs as another user or in another pid namespace.
    if recorded_alive:
        return (
            f"rank {rank}: segment {segment} belongs to a live process (pid "
            f"{recorded}, as its owner record {busy.path!r} says); another engine "
            f"uses the same address {address}. {fix}"
        )
    return (
        f"rank {rank}: segment {segment} is still held: its owner record "
        f"{busy.path!r} was made by pid {recorded}, which is gone, and its lock is "
        f"held by a process this user cannot inspect (another user's, or one in "
        f"another pid namespace). Stop it and start this engine again. {fix}"
    )


def _pid_alive(pid: str) -> bool:
    # An unreadable pid counts as running, since nothing says it has gone.
    if not pid.isascii() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True


def busy_owner_error(
    namespace: ShmNamespace, rank: int, busy: Optional[BusyRecord]
) -> ShmCollectiveError:
    """The error for ``rank``'s owner record held by someone else (``busy``; None
    when records kept coming and going), naming who holds it."""
    return ShmCollectiveError(
        describe_busy_owner(
            rank=rank,
            segment=namespace.segment_name(rank),
            address=namespace.describe(),
            busy=busy,
            holders=[] if busy is None else _lock_holders(busy),
            recorded_alive=busy is not None and _pid_alive(busy.recorded_pid),
        )
    )


def _usage(shm_dir: str) -> tuple[int, int]:
    """``(free, total)`` bytes of the file system at ``shm_dir``."""
    info = os.statvfs(shm_dir)
    return info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize


def _full_shm_error(
    *, rank: int, shm_dir: str, needed: int, segment: str, failed: Optional[str] = None
) -> ShmCollectiveError:
    """For a ``shm_dir`` without room for ``needed`` more bytes. ``segment`` is the
    rank's segment path; ``failed`` the file whose write failed, when one did."""
    free, total = _usage(shm_dir)
    size = -(-(total - free + needed) // _MIB)  # MiB, rounded up
    what = f"writing {failed!r} failed: " if failed else ""
    return ShmCollectiveError(
        f"rank {rank}: {what}{shm_dir!r} has {free} of {total} bytes free, but the "
        f"CPU shared-memory all-reduce needs {needed} bytes more there: each rank's "
        f"segment (this rank's is {segment!r}) takes {KERNEL_SEGMENT_BYTES} bytes, "
        f"about {KERNEL_SEGMENT_BYTES // _MIB} MiB. Grow it to at least {size} MiB: "
        f"as root, `mount -o remount,size={size}M {shm_dir}`; in a container, start "
        f"it with `--shm-size={size}m` (docker) or a larger memory-backed volume at "
        f"{shm_dir}; or remove what else fills it"
    )


@contextlib.contextmanager
def explained_shm_errors(
    *, namespace: ShmNamespace, rank: int, shm_dir: str
) -> Iterator[None]:
    """Turn ENOSPC, EDQUOT and EROFS raised in the block into errors that name the
    file and the fix; other errors pass unchanged."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        segment = os.path.join(shm_dir, namespace.segment_name(rank))
        path = exc.filename if isinstance(exc.filename, str) else segment
        if exc.errno == errno.EROFS:
            raise ShmCollectiveError(
                f"rank {rank}: cannot create {path!r}: {shm_dir!r} is mounted "
                f"read-only, and the CPU shared-memory all-reduce keeps its segments "
                f"there. Mount it read-write (as root, `mount -o remount,rw "
                f"{shm_dir}`); in a container, do not mount {shm_dir} read-only"
            ) from exc
        # At least this rank's segment; its peers' are counted before the kernel runs.
        raise _full_shm_error(
            rank=rank,
            shm_dir=shm_dir,
            needed=KERNEL_SEGMENT_BYTES,
            segment=segment,
            failed=path,
        ) from exc


def segment_bytes_missing(
    sizes: Sequence[Optional[int]], *, segment_bytes: int = KERNEL_SEGMENT_BYTES
) -> int:
    """How many bytes the kernel will still write into segments of these current
    sizes (None: absent) (pure)."""
    return sum(segment_bytes - min(size or 0, segment_bytes) for size in sizes)


def ensure_segment_space(
    namespace: ShmNamespace, *, rank: int, tp_size: int, shm_dir: str = SHM_DIR
) -> None:
    """Raise :class:`ShmCollectiveError` unless ``shm_dir`` has room for the segments
    that the ``tp_size`` ranks of ``namespace`` have still to write.

    The CPU kernel write()s its segment without checking for a short write, and
    its ranks then map the full size: past the end of a short file, the first
    touch is a SIGBUS. A /dev/shm too small for that (docker's default is 64 MiB)
    is therefore refused here, before the kernel runs.
    """
    sizes = []
    for peer in range(tp_size):
        try:
            path = os.path.join(shm_dir, namespace.segment_name(peer))
            sizes.append(os.lstat(path).st_size)
        except FileNotFoundError:
            sizes.append(None)
    needed = segment_bytes_missing(sizes)
    if _usage(shm_dir)[0] < needed:
        raise _full_shm_error(
            rank=rank,
            shm_dir=shm_dir,
            needed=needed,
            segment=os.path.join(shm_dir, namespace.segment_name(rank)),
        )
