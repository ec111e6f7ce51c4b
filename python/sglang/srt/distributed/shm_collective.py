"""sgl_kernel's ``initialize`` for one :class:`ShmNamespace`; for the released kernel,
each rank's segment is made here first and unlinked after a TP barrier."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from typing import Iterator, Mapping, Optional, Sequence

import torch

from sglang.srt.distributed.shm_namespace import (
    MAX_RANK,
    ShmCollectiveError,
    ShmNamespace,
    check_int,
)

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# sizeof(struct allreduce_workspace) in shm.cpp, which write()s it into each segment.
KERNEL_SEGMENT_BYTES = 2 * 4 + 2 * (1 << 20) + 2 * (32 << 20)
_ENVIRON_LOCK = threading.RLock()  # two threads must not restore each other's values
_PENDING: list[tuple[int, str]] = []  # (pid, path): a forked child skips its parent's
_KINDS = {("int", "int"): "released", ("int", "int", "str"): "namespaced"}


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    with _ENVIRON_LOCK:
        previous = {name: os.environ.get(name) for name in values}
        try:
            os.environ.update(values)
            yield
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def segment_bytes_missing(sizes: Sequence[Optional[int]]) -> int:
    """Bytes the kernel will still write into segments of these sizes (None: absent)."""
    return sum(KERNEL_SEGMENT_BYTES - min(s or 0, KERNEL_SEGMENT_BYTES) for s in sizes)


def _check_room(rank: int, needed: int, segment: str) -> None:
    info = os.statvfs(SHM_DIR)
    free, total = info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize
    size = -(-(total - free + needed) >> 20)  # MiB, rounded up
    if free < needed:
        raise ShmCollectiveError(
            f"rank {rank}: {SHM_DIR!r} has {free} of {total} bytes free, but the CPU "
            f"shared-memory all-reduce needs {needed} bytes more (a rank's segment is "
            f"{KERNEL_SEGMENT_BYTES} bytes, about {KERNEL_SEGMENT_BYTES >> 20} MiB; "
            f"this rank's is {segment!r}). Grow it to {size} MiB (`mount -o remount,"
            f"size={size}M {SHM_DIR}` as root, `--shm-size={size}m` in docker)"
        )


def _lstat(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _check_owner(rank: int, path: str, info: Optional[os.stat_result]) -> None:
    if info is not None and info.st_uid != os.geteuid():
        raise ShmCollectiveError(
            f"rank {rank}: {path!r} is owned by uid {info.st_uid}, not {os.geteuid()}:"
            f" the kernel would fail on it or share it. Have uid {info.st_uid} (or "
            f"root) remove it, or give this engine another --dist-init-addr or port"
        )


def _prepare(namespace: ShmNamespace, *, tp_size: int, rank: int) -> None:
    # The kernel never checks its write(); a short segment's mapping would SIGBUS.
    paths = [os.path.join(SHM_DIR, namespace.segment_name(r)) for r in range(tp_size)]
    for path in paths:
        _check_owner(rank, path, _lstat(path))
    own = paths[rank]
    try:
        fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if isinstance(exc, PermissionError):  # a file planted since the check above
            _check_owner(rank, own, _lstat(own))
        if exc.errno == errno.ENOSPC:
            _check_room(rank, KERNEL_SEGMENT_BYTES, own)
        if exc.errno != errno.EROFS:
            raise
        raise ShmCollectiveError(
            f"rank {rank}: cannot create {own!r}: {SHM_DIR!r} is mounted read-only; "
            f"mount it read-write (`mount -o remount,rw {SHM_DIR}` as root, or not "
            f"read-only in a container)"
        ) from exc
    try:
        _check_owner(rank, own, os.fstat(fd))
    finally:
        os.close(fd)
    _PENDING.append((os.getpid(), own))
    sizes = [getattr(_lstat(path), "st_size", None) for path in paths]
    _check_room(rank, segment_bytes_missing(sizes), own)


def init_shm_collective(namespace: ShmNamespace, *, tp_size: int, tp_rank: int) -> bool:
    """True once ``sgl_kernel::initialize`` ran; False where no such op exists."""
    check_int("tp_size", tp_size, 1, MAX_RANK + 1)
    check_int("tp_rank", tp_rank, 0, tp_size - 1)
    try:  # whoever wants the CPU kernel imports its package first
        op = torch.ops.sgl_kernel.initialize
    except (AttributeError, RuntimeError):
        logger.debug(f"rank {tp_rank}: no sgl_kernel::initialize op, no shm collective")
        return False
    schema = op.default._schema
    kind = _KINDS.get(tuple(str(argument.type) for argument in schema.arguments))
    if kind is None:
        raise ShmCollectiveError(
            f"sgl_kernel::initialize has schema {schema}; expected initialize(int "
            f"size, int rank) or initialize(int size, int rank, str namespace): "
            f"install the sgl-kernel CPU build that matches this sglang"
        )
    if kind == "namespaced":
        op(tp_size, tp_rank, namespace.prefix)
    else:
        try:
            _prepare(namespace, tp_size=tp_size, rank=tp_rank)
            addr, port = namespace.kernel_addr, str(namespace.port)
            environ = {"MASTER_ADDR": addr, "MASTER_PORT": port}
            with scoped_environ({**environ, "LOCAL_SIZE": str(tp_size)}):
                op(tp_size, tp_rank)
        except BaseException:
            unlink_shm_segments()
            raise
    logger.info(
        f"rank {tp_rank}: CPU shared-memory collective initialised ({kind} kernel, "
        f"segment {SHM_DIR}/{namespace.segment_name(tp_rank)})"
    )
    return True


def unlink_shm_segments() -> list[str]:
    """Unlink this process's segments: only once all ranks are past ``initialize``."""
    unlinked = [path for pid, path in reversed(_PENDING) if pid == os.getpid()]
    _PENDING.clear()
    for path in unlinked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return unlinked


def finish_shm_collective() -> list[str]:
    """After sglang built its groups: a TP barrier, then the unlink (also on error)."""
    if not _PENDING:
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
) -> bool:
    method = dist_init_method or "env://"
    namespace = ShmNamespace.from_init_method(method, pp_rank=pp_rank)
    return init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)
