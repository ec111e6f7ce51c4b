"""sgl_kernel's CPU shared-memory all-reduce for one engine stage. The released kernel
names segments by MASTER_ADDR/MASTER_PORT at ``initialize(size, rank)``: set to the
stage's own address (ShmNamespace) for that call only. This rank's segment is made
here first, checked against what the kernel mapped, and unlinked once all are mapped.

A kernel whose ``initialize`` takes a group is called once sglang's groups exist:
TP rank 0 draws the launch's nonce, every rank receives it over the TP group, and
the kernel names, sets up, fails (all ranks or none) and unlinks on its own, within
the engine's ``--dist-timeout``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.distributed.shm_namespace import (
    MAX_RANK,
    ShmCollectiveError,
    ShmNamespace,
    check_int,
)
from sglang.srt.utils import temp_set_env

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# The kernel write()s its segment unchecked: a first page allocated here keeps that
# write from failing outright on a full /dev/shm (a crash in initialize).
FIRST_PAGE = 4096
# (pid, path, inode) of this rank's segment; a forked child leaves its parent's alone.
_PENDING: List[Tuple[int, str, int]] = []
# The group's most: sgl_kernel's bound on its timeout.
GROUP_TIMEOUT_MAX_S = 7 * 24 * 3600.0
_GROUPS: List[Tuple[int, ShmNamespace, int, int]] = []  # pid, namespace, size, rank


def shm_mappings() -> Dict[int, Tuple[str, int]]:
    """This process's /dev/shm mappings: inode -> (path, bytes of the file mapped)."""
    with open("/proc/self/maps") as maps:
        rows = [line.split(maxsplit=5) for line in maps]
    found = {}
    for span, _, offset, _, inode, *path in rows:
        if path and path[0].startswith(SHM_DIR + "/"):
            start, end = (int(x, 16) for x in span.split("-"))
            name = path[0].strip().removesuffix(" (deleted)")
            found[int(inode)] = (name, int(offset, 16) + end - start)
    return found


def _no_room(rank: int, path: str, error: int, missing: int = 0):
    if error == errno.EROFS:
        return ShmCollectiveError(
            f"rank {rank}: cannot create {path!r}: {SHM_DIR} is mounted read-only; "
            f"mount it read-write (`mount -o remount,rw {SHM_DIR}` as root)"
        )
    info = os.statvfs(SHM_DIR)
    free, total = info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize
    need = f"needs {missing} bytes more" if missing else "does not fit"
    size = f"{-(-(total - free + missing) >> 20)}M" if missing else "<larger>"
    return ShmCollectiveError(
        f"rank {rank}: {SHM_DIR} has {free} of {total} bytes free; {path!r} {need}: "
        f"grow it (`mount -o remount,size={size} {SHM_DIR}` as root, `--shm-size="
        f"{size.lower()}` in docker)"
    )


def _prepare(namespace: ShmNamespace, *, tp_size: int, rank: int) -> Tuple:
    """This rank's segment, made before the kernel opens (and reuses) it."""
    for path in (f"{SHM_DIR}/{namespace.segment_name(r)}" for r in range(tp_size)):
        uid = os.lstat(path).st_uid if os.path.lexists(path) else os.geteuid()
        if uid != os.geteuid():
            raise ShmCollectiveError(
                f"rank {rank}: {path!r} is owned by uid {uid}, not {os.geteuid()}: "
                f"the kernel would fail on it or share it. Have uid {uid} (or root) "
                f"remove it, or give this engine another --dist-init-addr or port"
            )
    own = f"{SHM_DIR}/{namespace.segment_name(rank)}"
    try:
        fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        segment = (os.getpid(), own, os.fstat(fd).st_ino)
    except OSError as exc:
        raise _no_room(rank, own, exc.errno) if exc.errno == errno.EROFS else exc
    try:  # A name stays on error: peers wait for it, as long as the kernel lives.
        os.posix_fallocate(fd, 0, FIRST_PAGE)
    except OSError as exc:
        raise _no_room(rank, own, exc.errno) if exc.errno == errno.ENOSPC else exc
    finally:
        os.close(fd)
    return segment


def init_shm_collective(namespace: ShmNamespace, *, tp_size: int, tp_rank: int) -> None:
    """``initialize(size, rank)`` of the released kernel, for this stage."""
    check_int("tp_size", tp_size, 1, MAX_RANK + 1)
    check_int("tp_rank", tp_rank, 0, tp_size - 1)
    segment = _prepare(namespace, tp_size=tp_size, rank=tp_rank)
    before = shm_mappings()
    address = {"MASTER_ADDR": namespace.kernel_addr, "MASTER_PORT": namespace.port}
    with temp_set_env(**address, LOCAL_SIZE=tp_size):
        torch.ops.sgl_kernel.initialize(tp_size, tp_rank)
    mapped = {k: v for k, v in shm_mappings().items() if k not in before}
    if segment[2] not in mapped:
        _unlink(segment)  # not the kernel's: nobody waits for it
        raise ShmCollectiveError(
            f"rank {tp_rank}: sgl_kernel::initialize did not map {segment[1]!r} "
            f"but {sorted(path for path, _ in mapped.values())}: it names its "
            f"segments otherwise; install the sgl-kernel that matches sglang"
        )
    # A peer's mapping is the whole segment; a short one is a SIGBUS for peers.
    have = -(-os.stat(segment[1]).st_size // mmap.PAGESIZE) * mmap.PAGESIZE
    missing = max(n for _, n in mapped.values()) - have
    if missing > 0:
        raise _no_room(tp_rank, segment[1], errno.ENOSPC, missing)
    _PENDING.append(segment)
    logger.info(f"rank {tp_rank}: CPU shared-memory all-reduce on {segment[1]}")


def _unlink(segment: Tuple[int, str, int]) -> bool:
    _, path, inode = segment
    if os.path.lexists(path) and os.lstat(path).st_ino == inode:
        os.unlink(path)
        return True
    logger.warning(f"{path!r} no longer names this rank's segment: kept")
    return False


def unlink_shm_segments() -> List[str]:
    """Unlink this process's segments: only once all ranks are past ``initialize``."""
    mine = [segment for segment in _PENDING if segment[0] == os.getpid()]
    _PENDING.clear()
    return [segment[1] for segment in mine if _unlink(segment)]


def finish_shm_collective() -> List[str]:
    """After sglang built its groups: a TP barrier, then the unlink (also on error)."""
    if any(pid == os.getpid() for pid, *_ in _GROUPS):
        _join_group()
        return []
    if not any(segment[0] == os.getpid() for segment in _PENDING):
        return []
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    try:
        group.barrier()
    finally:
        unlinked = unlink_shm_segments()
    logger.info(f"rank {group.rank_in_group}: unlinked {unlinked}: all ranks map it")
    return unlinked


def start_shm_collective(
    *, dist_init_method: Optional[str], tp_size: int, tp_rank: int, pp_rank: int
) -> None:
    method = dist_init_method or "env://"
    namespace = ShmNamespace.from_init_method(method, pp_rank=pp_rank)
    schema = torch.ops.sgl_kernel.initialize.default._schema
    if "group" in [argument.name for argument in schema.arguments]:
        check_int(
            "tp_rank", tp_rank, 0, check_int("tp_size", tp_size, 1, MAX_RANK + 1) - 1
        )
        _GROUPS.append((os.getpid(), namespace, tp_size, tp_rank))  # see _join_group
        return
    init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)


def shm_group_timeout(dist_timeout: Optional[int]) -> float:
    """The engine's ``--dist-timeout``, else torch's default process-group timeout."""
    if dist_timeout is None:
        return torch.distributed.constants.default_pg_timeout.total_seconds()
    return float(min(dist_timeout, GROUP_TIMEOUT_MAX_S))


def join_shm_group(
    namespace: ShmNamespace, *, tp_size: int, tp_rank: int, group: str, timeout: float
) -> None:
    """``initialize(size, rank, namespace, group, timeout)``: every rank of the group
    returns set up, or every rank raises within ``timeout``; nothing is left."""
    name = namespace.group_namespace
    torch.ops.sgl_kernel.initialize(tp_size, tp_rank, name, group, timeout)
    logger.info(f"rank {tp_rank}: CPU shared-memory all-reduce in {name}_{group}")


def _join_group() -> None:
    """Called once the TP group exists: its rank 0 draws the launch's nonce."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    [(_, namespace, tp_size, tp_rank)] = [g for g in _GROUPS if g[0] == os.getpid()]
    _GROUPS.clear()
    coordinator, nonce = get_tp_group(), [secrets.token_hex(8)]
    if coordinator.world_size > 1:
        torch.distributed.broadcast_object_list(
            nonce, src=coordinator.ranks[0], group=coordinator.cpu_group
        )
    timeout = shm_group_timeout(get_parallel().dist_timeout)
    join_shm_group(
        namespace, tp_size=tp_size, tp_rank=tp_rank, group=nonce[0], timeout=timeout
    )
