"""The CPU collective's set-up: sgl_kernel's ``initialize`` given this engine's
:class:`ShmNamespace`.

A kernel that takes the namespace (``initialize(int size, int rank, str namespace)``)
creates its segment exclusively, waits for its peers with a deadline and unlinks its
name once every peer has mapped it: it gets the namespace and nothing else. The
released kernel (``initialize(int size, int rank)``) names its segments from
``MASTER_ADDR``/``MASTER_PORT`` (set here for the call only), reuses a file of that
name, waits for peers forever and never unlinks: each rank's segment is created here
first (another user's file refused, room checked), and each rank unlinks its name
after a barrier on the stage's TP group, built after ``initialize`` on every rank.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from typing import Callable, Iterator, Mapping, Optional, Sequence

from sglang.srt.distributed.shm_namespace import (
    MAX_RANK,
    ShmCollectiveError,
    ShmNamespace,
    check_int,
)

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# sizeof(struct allreduce_workspace) in shm.cpp: two int states, a double buffer of
# 1 MiB and one of 32 MiB. The kernel write()s this much into each rank's segment.
KERNEL_SEGMENT_BYTES = 2 * 4 + 2 * (1 << 20) + 2 * (32 << 20)
_MIB = 1 << 20
# os.environ is process-wide: two threads must not restore each other's values.
_SCOPED_ENVIRON_LOCK = threading.RLock()
# (pid, path) of the segments this process created and has not unlinked yet; the
# pid keeps a forked child from unlinking its parent's.
_PENDING: list[tuple[int, str]] = []
_KINDS = {("int", "int"): "released", ("int", "int", "str"): "namespaced"}


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    with _SCOPED_ENVIRON_LOCK:
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
    full = KERNEL_SEGMENT_BYTES
    return sum(full - min(size or 0, full) for size in sizes)


def _full_error(rank: int, needed: int, segment: str) -> ShmCollectiveError:
    info = os.statvfs(SHM_DIR)
    free, total = info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize
    size = -(-(total - free + needed) // _MIB)  # MiB, rounded up
    return ShmCollectiveError(
        f"rank {rank}: {SHM_DIR!r} has {free} of {total} bytes free, but the CPU "
        f"shared-memory all-reduce needs {needed} bytes more there: each rank's "
        f"segment (this rank's is {segment!r}) takes {KERNEL_SEGMENT_BYTES} bytes, "
        f"about {KERNEL_SEGMENT_BYTES // _MIB} MiB. Grow it to at least {size} MiB: "
        f"as root, `mount -o remount,size={size}M {SHM_DIR}`; in a container, start "
        f"it with `--shm-size={size}m` (docker) or a larger memory-backed volume at "
        f"{SHM_DIR}; or remove what else fills it"
    )


def _lstat(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _check_owner(rank: int, path: str, info: Optional[os.stat_result]) -> None:
    if info is not None and info.st_uid != os.geteuid():
        raise ShmCollectiveError(
            f"rank {rank}: {path!r} is owned by uid {info.st_uid}, not by this "
            f"process's uid {os.geteuid()}: another user made a file under this "
            f"engine's segment name, which the CPU kernel would fail to open or would "
            f"share with that user. Have uid {info.st_uid} (or root) remove it, or "
            f"give this engine another --dist-init-addr or port"
        )


def _prepare(namespace: ShmNamespace, *, tp_size: int, rank: int) -> None:
    """Refuse another user's file under the engine's names, create this rank's
    segment, and check for room: the kernel never checks its write(), and touching
    a mapping past the end of a short file is a SIGBUS."""
    paths = [os.path.join(SHM_DIR, namespace.segment_name(r)) for r in range(tp_size)]
    for path in paths:
        _check_owner(rank, path, _lstat(path))
    own = paths[rank]
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(own, flags, 0o600)
    except PermissionError:
        _check_owner(rank, own, _lstat(own))
        raise
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise ShmCollectiveError(
                f"rank {rank}: cannot create {own!r}: {SHM_DIR!r} is mounted "
                f"read-only, and the CPU shared-memory all-reduce keeps its segments "
                f"there. Mount it read-write (as root, `mount -o remount,rw "
                f"{SHM_DIR}`); in a container, do not mount it read-only"
            ) from exc
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _full_error(rank, KERNEL_SEGMENT_BYTES, own) from exc
        raise
    try:
        _check_owner(rank, own, os.fstat(fd))
    finally:
        os.close(fd)
    _PENDING.append((os.getpid(), own))
    needed = segment_bytes_missing([getattr(_lstat(p), "st_size", None) for p in paths])
    info = os.statvfs(SHM_DIR)
    if info.f_bavail * info.f_frsize < needed:
        raise _full_error(rank, needed, own)


def init_shm_collective(namespace: ShmNamespace, *, tp_size: int, tp_rank: int) -> bool:
    """True once ``sgl_kernel::initialize`` ran; False where no such op is registered.
    With the released kernel, the caller unlinks once every rank is past it
    (:func:`finish_shm_collective`)."""
    check_int("tp_size", tp_size, 1, MAX_RANK + 1)
    check_int("tp_rank", tp_rank, 0, tp_size - 1)
    try:  # whoever wants the CPU kernel imports its package first
        import torch

        op = torch.ops.sgl_kernel.initialize
    except (ImportError, AttributeError, RuntimeError):
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
        _init_released(op, namespace, tp_size=tp_size, tp_rank=tp_rank)
    logger.info(
        f"rank {tp_rank}: CPU shared-memory collective initialised (segment "
        f"{SHM_DIR}/{namespace.segment_name(tp_rank)}, tp_size={tp_size}, {kind} "
        f"kernel schema)"
    )
    return True


def _init_released(
    op: Callable[..., None], namespace: ShmNamespace, *, tp_size: int, tp_rank: int
) -> None:
    kernel_environ = {
        "MASTER_ADDR": namespace.kernel_addr,
        "MASTER_PORT": str(namespace.port),
        "LOCAL_SIZE": str(tp_size),
    }
    try:
        _prepare(namespace, tp_size=tp_size, rank=tp_rank)
        with scoped_environ(kernel_environ):
            op(tp_size, tp_rank)
    except BaseException:
        unlink_shm_segments()
        raise


def unlink_shm_segments() -> list[str]:
    """Unlink the segments this process created; their mappings stay valid. Only once
    every rank of their namespace is past ``initialize``: a peer still in its open
    loop would wait forever for a name unlinked before it opened it."""
    unlinked = []
    while _PENDING:
        pid, path = _PENDING.pop()
        if pid == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            unlinked.append(path)
    return unlinked


def finish_shm_collective() -> list[str]:
    """Once sglang has built its groups: a barrier on the TP group (every rank called
    ``initialize`` before building them), then the unlink, also if the barrier
    fails."""
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
    namespace = ShmNamespace.from_init_method(
        dist_init_method or "env://", pp_rank=pp_rank
    )
    return init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)
