"""Per-rank bootstrap: torch.distributed, CPU thread binding and the CPU shared-memory collective.

The CPU build of ``sgl_kernel`` names its ``/dev/shm`` segments
``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, where ``<uid>`` is the
real user id of the process (``getuid()``) and ``<addr>``/``<port>`` are read from
``MASTER_ADDR``/``MASTER_PORT``. Two engines on one host must therefore never hand
the kernel the same address and port. Here the name is an explicit value,
:class:`ShmNamespace`, built from the engine's own init address; the process
environment is never left changed.

Owner records
    The kernel's segments carry no owner pid, so each rank keeps a lock file,
    ``<shm_dir>/sglang_shm_owners_<uid>/<segment>.owner`` (directory 0700, file
    0600), and holds an exclusive ``flock`` on it for as long as it lives. The
    kernel drops that lock when the process dies, however it dies, and ``flock``
    works across pid namespaces that share ``/dev/shm``. A segment whose record
    can be locked by someone else has no live owner and is removed; one whose
    record is locked is live and never touched; one with no record at all (made
    by code that keeps none) is reported and left alone.

Kernel schemas
    ``initialize(int size, int rank) -> ()`` (the released CPU build) reads the
    names from the environment; it is called with ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``LOCAL_SIZE`` set only for the call.
    ``initialize(int size, int rank, str namespace) -> ()`` takes the segment
    prefix (``ShmNamespace.prefix``: the whole name up to ``_<rank>``), appends
    ``_<rank>`` for each rank's segment, and treats all ``size`` ranks as local.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from sglang.srt.environ import envs
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.utils.network import (
    AddressError,
    parse_port,
    parse_tcp_init_method,
    split_host_port,
    tcp_init_method,
)

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
NAME_MAX = 255
# Ranks up to 99999 are reserved room in every name, so a namespace that passes
# validation never yields an over-long segment name later.
_RANK_DIGITS = 5
_MAX_RANK = 10**_RANK_DIGITS - 1
_OWNER_DIR_PREFIX = "sglang_shm_owners"
_OWNER_SUFFIX = ".owner"
# Reserved for the pipeline-stage suffix; never valid in a host name or address.
_STAGE_MARK = "@pp"
_ADDR_RE = re.compile(r"[A-Za-z0-9._:%-]+")
_KERNEL_ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")


class ShmNamespaceError(ValueError):
    """A value that names shared-memory segments is not usable."""


class ShmOwnerError(RuntimeError):
    """A segment's owner record cannot be created or is held by a live process."""


class ShmCollectiveError(RuntimeError):
    """The registered kernel op has a shape this module does not know."""


class ThreadBindingError(ValueError):
    """A rank's CPU list cannot be applied."""


class DistributedInitError(ValueError):
    """The distributed settings of a rank do not fit together."""


# --------------------------------------------------------------------------- namespace


@dataclasses.dataclass(frozen=True)
class ShmNamespace:
    """Names one engine's (one pipeline stage's) shared-memory segments.

    ``addr`` and ``port`` come from the engine's init address; ``uid`` is the real
    user id the kernel puts in the name; ``pp_rank`` > 0 gives each pipeline stage
    of one engine its own segments (stage 0 keeps the released kernel's names).
    ``port`` 0 means the rendezvous is not over TCP (see :meth:`from_init_method`).
    """

    addr: str
    port: int
    uid: int = dataclasses.field(default_factory=os.getuid)
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.addr, str) or not self.addr:
            raise ShmNamespaceError(
                f"ShmNamespace.addr={self.addr!r}: expected a non-empty host name or address"
            )
        if "/" in self.addr:
            raise ShmNamespaceError(
                f"ShmNamespace.addr={self.addr!r} contains '/', which cannot appear in a "
                f"/dev/shm segment name; use the host's name or IP address"
            )
        if not _ADDR_RE.fullmatch(self.addr):
            bad = sorted({c for c in self.addr if not _ADDR_RE.fullmatch(c)})
            raise ShmNamespaceError(
                f"ShmNamespace.addr={self.addr!r} contains {''.join(bad)!r}; only letters, "
                f"digits and . _ - : % are allowed in a /dev/shm segment name"
            )
        for name, value, low, high in (
            ("port", self.port, 0, 65535),
            ("uid", self.uid, 0, 2**32 - 1),
            ("pp_rank", self.pp_rank, 0, _MAX_RANK),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ShmNamespaceError(
                    f"ShmNamespace.{name}={value!r}: expected an integer from {low} to {high}"
                )
        longest = len(self.segment_name(_MAX_RANK))
        if longest > NAME_MAX:
            raise ShmNamespaceError(
                f"ShmNamespace.addr={self.addr!r} is too long: segment names would be up to "
                f"{longest} characters, over the {NAME_MAX} allowed in /dev/shm; give "
                f"--dist-init-addr (or --host) as an IP address or a shorter host name"
            )

    @classmethod
    def from_init_method(
        cls,
        method: str,
        *,
        uid: Optional[int] = None,
        pp_rank: int = 0,
        environ: Optional[Mapping[str, str]] = None,
    ) -> "ShmNamespace":
        """The namespace of the engine whose ``torch.distributed`` init method is ``method``.

        ``tcp://host:port`` and ``tcp://[ipv6]:port`` give ``(host, port)``. Fallbacks:
        ``env://`` reads (never writes) ``MASTER_ADDR``/``MASTER_PORT`` from ``environ``
        (default ``os.environ``), as torch does for that method; ``file:///path`` has no
        address, so the address becomes ``file.<16 hex of sha256(path)>`` and the port 0.
        """
        what = f"dist_init_method={method!r}"
        extra: dict[str, Any] = {"pp_rank": pp_rank}
        if uid is not None:
            extra["uid"] = uid
        if not isinstance(method, str) or not method.strip():
            raise ShmNamespaceError(
                f"dist_init_method={method!r}: expected 'tcp://host:port', 'env://' "
                f"or 'file://path'"
            )
        method = method.strip()
        scheme = method.split("://", 1)[0].lower() if "://" in method else ""
        try:
            if scheme == "tcp":
                host, port = parse_tcp_init_method(method, what=what)
            elif scheme == "env":
                env = os.environ if environ is None else environ
                host = env.get("MASTER_ADDR", "")
                port_text = env.get("MASTER_PORT", "")
                if not host or not port_text:
                    raise ShmNamespaceError(
                        f"{what} takes the address from MASTER_ADDR and MASTER_PORT, but "
                        f"MASTER_ADDR={host!r}, MASTER_PORT={port_text!r}; set both, or use "
                        f"a tcp://host:port init method"
                    )
                if host.startswith("[") and host.endswith("]"):
                    host = host[1:-1]
                port = parse_port(port_text, what="MASTER_PORT")
            elif scheme == "file":
                path = method[len("file://") :]
                if not path:
                    raise ShmNamespaceError(f"{what} names no file; expected 'file:///path'")
                digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
                host, port = f"file.{digest}", 0
            else:
                raise ShmNamespaceError(
                    f"{what}: unsupported scheme; expected 'tcp://host:port', "
                    f"'tcp://[ipv6]:port', 'env://' or 'file:///path'"
                )
        except AddressError as exc:
            raise ShmNamespaceError(str(exc)) from None
        try:
            return cls(addr=host, port=port, **extra)
        except ShmNamespaceError as exc:
            raise ShmNamespaceError(f"{what}: {exc}") from None

    def for_stage(self, pp_rank: int) -> "ShmNamespace":
        """The namespace of pipeline stage ``pp_rank`` of the same engine."""
        return dataclasses.replace(self, pp_rank=pp_rank)

    @property
    def kernel_addr(self) -> str:
        """The address part of segment names (``MASTER_ADDR`` for the released kernel)."""
        return self.addr if self.pp_rank == 0 else f"{self.addr}{_STAGE_MARK}{self.pp_rank}"

    @property
    def kernel_port(self) -> str:
        return str(self.port)

    @property
    def prefix(self) -> str:
        """Every segment name of this namespace is ``prefix + "_" + rank``."""
        return f"{SHM_SEGMENT_PREFIX}_{self.uid}_{self.kernel_addr}_{self.kernel_port}"

    def segment_name(self, rank: int) -> str:
        """The ``/dev/shm`` name the CPU kernel uses for ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= _MAX_RANK:
            raise ShmNamespaceError(f"rank={rank!r}: expected an integer from 0 to {_MAX_RANK}")
        return f"{self.prefix}_{rank}"

    def rank_of(self, name: str) -> Optional[int]:
        """The rank if ``name`` is one of this namespace's segment names, else None."""
        head = self.prefix + "_"
        if not name.startswith(head):
            return None
        tail = name[len(head) :]
        if not tail.isdigit() or len(tail) > _RANK_DIGITS or (len(tail) > 1 and tail[0] == "0"):
            return None
        return int(tail)


# ---------------------------------------------------------------- init method resolution


def resolve_dist_init_method(
    *,
    override: Optional[str] = None,
    dist_init_method: Optional[str] = None,
    dist_init_addr: Optional[str] = None,
    host: Optional[str] = None,
    dist_port: Optional[int] = None,
) -> str:
    """The ``torch.distributed`` init method of an engine.

    In order: ``override`` (``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE``), an explicit
    ``dist_init_method``, ``dist_init_addr`` (``host:port`` or ``[ipv6]:port``), then
    ``host`` (default 127.0.0.1) with ``dist_port``, the engine's own distributed port
    (upstream's ``nccl_port``; not the HTTP ``--port``).
    """
    if override:
        return override
    if dist_init_method:
        return dist_init_method
    if dist_init_addr:
        try:
            addr_host, addr_port = split_host_port(dist_init_addr, what="--dist-init-addr")
        except AddressError as exc:
            raise DistributedInitError(str(exc)) from None
        return tcp_init_method(addr_host, addr_port)
    if dist_port is None:
        raise DistributedInitError(
            "no distributed init address: set --dist-init-addr, pass the engine's "
            "distributed port, or set SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
        )
    local_host = host or "127.0.0.1"
    if local_host.startswith("[") and local_host.endswith("]"):
        local_host = local_host[1:-1]
    try:
        checked = parse_port(str(dist_port), what="dist_port")
    except AddressError as exc:
        raise DistributedInitError(str(exc)) from None
    return tcp_init_method(local_host, checked)


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


# ----------------------------------------------------------------------------- kernel ops


def _find_kernel_op(name: str) -> Optional[Any]:
    """``torch.ops.sgl_kernel.<name>`` if registered. The kernel package is never
    imported here: whoever wants the CPU kernel imports it first."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return None


def _initialize_schema(op: Any) -> str:
    """``"released"`` for ``(int, int)``, ``"namespaced"`` for ``(int, int, str)``."""
    schema = op.default._schema
    types = [str(argument.type) for argument in schema.arguments]
    if types == ["int", "int"]:
        return "released"
    if types == ["int", "int", "str"]:
        return "namespaced"
    raise ShmCollectiveError(
        f"sgl_kernel::initialize has schema {schema}; expected "
        f"initialize(int size, int rank) or initialize(int size, int rank, str namespace)"
    )


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in the process environment for the block only, then put back the
    previous values (or their absence), also on error."""
    with _ENV_LOCK:
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


def init_shm_collective(
    namespace: ShmNamespace,
    *,
    tp_size: int,
    tp_rank: int,
    barrier: Optional[Callable[[], Any]] = None,
    shm_dir: str = SHM_DIR,
    owner_wait_s: float = 10.0,
) -> bool:
    """Initialise the CPU shared-memory collective of rank ``tp_rank`` in ``namespace``.

    Returns True if ``sgl_kernel::initialize`` was called, False (one DEBUG line) if no
    such op is registered. Before the call this rank locks its owner record, removes
    its own leftover segment and the namespace's segments whose owners are gone, then
    runs ``barrier`` (if given) so that no rank maps a peer's leftover segment.
    """
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DistributedInitError(f"{name}={value!r}: expected an integer")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise DistributedInitError(
            f"tp_rank={tp_rank}, tp_size={tp_size}: expected 0 <= tp_rank < tp_size"
        )
    op = _find_kernel_op("initialize")
    if op is None:
        logger.debug(
            f"rank {tp_rank}: no sgl_kernel::initialize op is registered; "
            f"the CPU shared-memory collective is not set up"
        )
        return False
    kind = _initialize_schema(op)
    segment = namespace.segment_name(tp_rank)

    key = (namespace, tp_rank, shm_dir)
    with _OWNED_LOCK:
        record = _OWNED.get(key)
    if record is None:
        record = _claim_owner(namespace, tp_rank, shm_dir=shm_dir, wait_s=owner_wait_s)
        try:
            # We hold the record, so any segment under our name is a dead owner's.
            if _unlink_quiet(os.path.join(shm_dir, segment)):
                logger.info(
                    f"rank {tp_rank}: removed stale shared-memory segment {segment} "
                    f"left by a previous owner"
                )
            remove_stale_segments(namespace, shm_dir=shm_dir, skip_rank=tp_rank)
        except BaseException:
            record.release(unlink_segment=False)
            raise
        _remember(record)
    if barrier is not None:
        barrier()

    try:
        if kind == "namespaced":
            op(tp_size, tp_rank, namespace.prefix)
        else:
            with _scoped_environ(
                {
                    "MASTER_ADDR": namespace.kernel_addr,
                    "MASTER_PORT": namespace.kernel_port,
                    "LOCAL_SIZE": str(tp_size),
                }
            ):
                op(tp_size, tp_rank)
    except BaseException:
        release_shm_collective(namespace, rank=tp_rank)
        raise
    logger.info(
        f"rank {tp_rank}: CPU shared-memory collective initialised "
        f"(segment {segment}, tp_size={tp_size}, {kind} kernel schema)"
    )
    return True


# ------------------------------------------------------------------------ thread binding


def _task_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def _pin_all_threads(cpus: frozenset[int]) -> int:
    """Pin every thread of this process to ``cpus``; threads created later inherit it."""
    pinned = 0
    for tid in _task_ids():
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except ProcessLookupError:
            # The thread exited between listing and pinning.
            continue
    return pinned


def bind_rank_threads(
    cpu_ids: str, *, tp_rank: int, numa_index: Optional[int], world_size: int
) -> str:
    """Run this rank's OMP and ATen threads on the CPUs of ``cpu_ids`` (a cpulist such
    as ``"0-3,8"``); returns the canonical cpulist applied.

    Uses ``sgl_kernel::init_cpu_threads_env`` when registered; otherwise sets
    ``torch.set_num_threads`` to the CPU count and pins every thread of the process.
    """
    cpus = parse_cpulist(cpu_ids, what=f"rank {tp_rank} cpu_ids")
    if not cpus:
        raise ThreadBindingError(
            f"rank {tp_rank}: cpu_ids={cpu_ids!r} names no CPU; expected a list such as '0-3,8'"
        )
    allowed = frozenset(os.sched_getaffinity(0))
    outside = cpus - allowed
    if outside:
        raise ThreadBindingError(
            f"rank {tp_rank}: CPUs {format_cpulist(outside)} of cpu_ids={cpu_ids!r} are not "
            f"available to this process (allowed: {format_cpulist(allowed)}); check "
            f"SGLANG_CPU_OMP_THREADS_BIND and any outer taskset, numactl or cpuset"
        )
    cpulist = format_cpulist(cpus)
    op = _find_kernel_op("init_cpu_threads_env")
    if op is not None:
        detail = op(cpulist)
        logger.debug(f"rank {tp_rank}: init_cpu_threads_env said: {detail}")
        how = "sgl_kernel.init_cpu_threads_env"
    else:
        import torch

        torch.set_num_threads(len(cpus))
        pinned = _pin_all_threads(cpus)
        how = f"torch.set_num_threads({len(cpus)}) and affinity of {pinned} threads"
    logger.info(
        f"rank {tp_rank}: bound OMP/ATen threads to CPUs {cpulist} "
        f"(numa_index={numa_index}, world_size={world_size}, via {how})"
    )
    return cpulist


# ------------------------------------------------------------------------ torch bootstrap


@dataclasses.dataclass(frozen=True)
class DistributedBootstrap:
    """What :func:`init_torch_distributed` set up for one rank."""

    init_method: str
    backend: str
    world_size: int
    rank: int
    namespace: Optional[ShmNamespace]
    shm_collective: bool
    bound_cpus: Optional[str]


_DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "npu": "hccl", "hpu": "hccl"}


def default_backend(device: str) -> str:
    """The ``torch.distributed`` backend for ``device``."""
    try:
        return _DEFAULT_BACKENDS[device]
    except KeyError:
        raise DistributedInitError(
            f"device={device!r} has no default distributed backend; pass backend= "
            f"(one of gloo, nccl, xccl, hccl)"
        ) from None


def tp_groups_are_node_local(*, world_size: int, tp_size: int, nnodes: int) -> bool:
    """Whether every TP group lies on one host (the shared-memory collective needs it)."""
    if nnodes <= 1:
        return True
    ranks_per_node, leftover = divmod(world_size, nnodes)
    return leftover == 0 and ranks_per_node % tp_size == 0


def _as_timedelta(timeout: Union[None, float, datetime.timedelta]) -> Optional[datetime.timedelta]:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise DistributedInitError(f"timeout={timeout!r}: expected seconds > 0 or a timedelta")
    return datetime.timedelta(seconds=timeout)


def _init_process_group(
    *, backend: str, init_method: str, world_size: int, rank: int,
    timeout: Optional[datetime.timedelta],
) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank, **kwargs
    )


def _world_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def init_torch_distributed(
    *,
    tp_size: int,
    tp_rank: int,
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    device: str = "cpu",
    backend: Optional[str] = None,
    dist_init_method: Optional[str] = None,
    dist_init_addr: Optional[str] = None,
    host: Optional[str] = None,
    dist_port: Optional[int] = None,
    nnodes: int = 1,
    cpu_ids: Optional[str] = None,
    numa_index: Optional[int] = None,
    timeout: Union[None, float, datetime.timedelta] = None,
    shm_dir: str = SHM_DIR,
) -> DistributedBootstrap:
    """Bring up one rank: ``torch.distributed``, then (on CPU) its thread binding and
    the shared-memory collective under the engine's own :class:`ShmNamespace`.

    ``world_size``/``rank`` default to ``tp_size``/``tp_rank`` (ranks are
    ``tp_size * pp_rank + tp_rank``). The init method comes from
    :func:`resolve_dist_init_method`. ``os.environ`` is the same afterwards.
    """
    world_size = tp_size if world_size is None else world_size
    rank = tp_rank if rank is None else rank
    for name, value in (
        ("tp_size", tp_size), ("tp_rank", tp_rank), ("world_size", world_size),
        ("rank", rank), ("nnodes", nnodes),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DistributedInitError(f"{name}={value!r}: expected an integer")
    if tp_size < 1 or world_size % tp_size:
        raise DistributedInitError(
            f"world_size={world_size} is not a multiple of tp_size={tp_size}"
        )
    if not 0 <= rank < world_size or rank % tp_size != tp_rank:
        raise DistributedInitError(
            f"rank={rank}, tp_rank={tp_rank}: expected 0 <= rank < world_size={world_size} "
            f"and rank % tp_size ({tp_size}) == tp_rank"
        )
    pp_rank = rank // tp_size

    init_method = resolve_dist_init_method(
        override=envs.SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE.get(),
        dist_init_method=dist_init_method,
        dist_init_addr=dist_init_addr,
        host=host,
        dist_port=dist_port,
    )
    chosen_backend = backend or default_backend(device)
    namespace: Optional[ShmNamespace] = None
    if device == "cpu":
        # Validated before any rendezvous, so a bad address fails fast on every rank.
        namespace = ShmNamespace.from_init_method(init_method, pp_rank=pp_rank)

    import torch.distributed as dist

    if dist.is_initialized():
        logger.debug(f"rank {rank}: torch.distributed already initialised; reusing it")
    else:
        logger.info(
            f"rank {rank}: init torch.distributed ({chosen_backend}, {init_method}, "
            f"world_size={world_size})"
        )
        _init_process_group(
            backend=chosen_backend, init_method=init_method, world_size=world_size,
            rank=rank, timeout=_as_timedelta(timeout),
        )

    bound: Optional[str] = None
    shm_ready = False
    if device == "cpu":
        if cpu_ids:
            bound = bind_rank_threads(
                cpu_ids, tp_rank=tp_rank, numa_index=numa_index, world_size=world_size
            )
        if tp_groups_are_node_local(world_size=world_size, tp_size=tp_size, nnodes=nnodes):
            shm_ready = init_shm_collective(
                namespace, tp_size=tp_size, tp_rank=tp_rank,
                barrier=_world_barrier if world_size > 1 else None, shm_dir=shm_dir,
            )
        else:
            logger.info(
                f"rank {rank}: TP groups span hosts (world_size={world_size}, "
                f"tp_size={tp_size}, nnodes={nnodes}); shared-memory collective not used"
            )
    return DistributedBootstrap(
        init_method=init_method,
        backend=chosen_backend,
        world_size=world_size,
        rank=rank,
        namespace=namespace,
        shm_collective=shm_ready,
        bound_cpus=bound,
    )


# ------------------------------------------------------------------ deprecated upstream shims


def _set_shm_master_env(dist_init_method: Optional[str]) -> None:
    """Deprecated: upstream's way of naming segments through ``MASTER_ADDR``/``MASTER_PORT``.

    Kept with its old behaviour (``setdefault`` into ``os.environ``) for callers that
    still call ``sgl_kernel.initialize`` themselves; use :class:`ShmNamespace` and
    :func:`init_shm_collective`, which leave the environment alone.
    """
    warnings.warn(
        "_set_shm_master_env is deprecated: build a ShmNamespace and call "
        "init_shm_collective, which does not change os.environ",
        DeprecationWarning,
        stacklevel=2,
    )
    prefix = "tcp://"
    if dist_init_method and dist_init_method.startswith(prefix):
        try:
            addr, port = parse_tcp_init_method(dist_init_method)
        except AddressError:
            return
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port))


def _init_cpu_threads_env(
    *,
    tp_size: int,
    tp_rank: int,
    local_omp_cpuid: Union[None, str, Iterable[int]],
    dist_init_method: Optional[str] = None,
) -> None:
    """Deprecated: use :func:`bind_rank_threads` and :func:`init_shm_collective`."""
    warnings.warn(
        "_init_cpu_threads_env is deprecated: use bind_rank_threads and "
        "init_shm_collective (or init_torch_distributed)",
        DeprecationWarning,
        stacklevel=2,
    )
    if local_omp_cpuid:
        cpu_ids = (
            local_omp_cpuid if isinstance(local_omp_cpuid, str)
            else format_cpulist(local_omp_cpuid)
        )
        bind_rank_threads(cpu_ids, tp_rank=tp_rank, numa_index=None, world_size=tp_size)
    if dist_init_method:
        init_shm_collective(
            ShmNamespace.from_init_method(dist_init_method), tp_size=tp_size, tp_rank=tp_rank
        )


__all__ = [
    "DistributedBootstrap",
    "DistributedInitError",
    "NAME_MAX",
    "SHM_DIR",
    "SHM_SEGMENT_PREFIX",
    "ShmCollectiveError",
    "ShmNamespace",
    "ShmNamespaceError",
    "ShmOwnerError",
    "StaleSweep",
    "ThreadBindingError",
    "bind_rank_threads",
    "default_backend",
    "init_shm_collective",
    "init_torch_distributed",
    "release_shm_collective",
    "remove_stale_segments",
    "resolve_dist_init_method",
    "tp_groups_are_node_local",
]
