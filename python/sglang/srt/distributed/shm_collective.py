"""Bring up one rank: ``torch.distributed``, its CPU thread binding and the CPU shared-memory collective.

The collective's segments are named by :class:`~sglang.srt.distributed.shm_namespace.ShmNamespace`
and owned through :mod:`sglang.srt.distributed.shm_segments`; both are re-exported
here for existing callers. The process environment is the same afterwards.

Kernel schemas
    ``initialize(int size, int rank) -> ()`` (the released CPU build) reads the
    names from the environment; it is called with ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``LOCAL_SIZE`` set only for the call.
    ``initialize(int size, int rank, str namespace) -> ()`` takes the segment
    prefix (``ShmNamespace.prefix``: the whole name up to ``_<rank>``), appends
    ``_<rank>`` for each rank's segment, and treats all ``size`` ranks as local.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Callable, Optional, Union

from sglang.srt.distributed.shm_namespace import (
    NAME_MAX,
    SHM_SEGMENT_PREFIX,
    ShmNamespace,
    ShmNamespaceError,
)
from sglang.srt.distributed.shm_segments import (
    SHM_DIR,
    ShmOwnerError,
    StaleSweep,
    claim_segment,
    release_shm_collective,
    remove_stale_segments,
)
from sglang.srt.environ import envs
from sglang.srt.placement.scoped_environ import scoped_environ
from sglang.srt.placement.apply import set_all_threads_affinity
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.distributed.init_address import (
    AddressError,
    parse_port,
    split_host_port,
    tcp_init_method,
)

logger = logging.getLogger(__name__)


class ShmCollectiveError(RuntimeError):
    """The registered kernel op has a shape this module does not know."""


class ThreadBindingError(ValueError):
    """A rank's CPU list cannot be applied."""


class DistributedInitError(ValueError):
    """The distributed settings of a rank do not fit together."""


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
    its own leftover segment and every segment of this uid whose owner is gone, then
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

    claim_segment(namespace, rank=tp_rank, shm_dir=shm_dir, wait_s=owner_wait_s)
    if barrier is not None:
        barrier()

    try:
        if kind == "namespaced":
            op(tp_size, tp_rank, namespace.prefix)
        else:
            with scoped_environ(
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
        pinned = set_all_threads_affinity(cpus)
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


def start_shm_collective(*, dist_init_method: Optional[str], tp_size: int, tp_rank: int) -> bool:
    """Bootstrap's CPU path: the shared-memory collective of this rank, named by the engine's own init method.

    This is what upstream's ``_init_cpu_threads_env`` delegates to instead of
    setting ``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_SIZE`` in ``os.environ``.
    Returns whether the kernel op was called (see :func:`init_shm_collective`).
    """
    namespace = ShmNamespace.from_init_method(dist_init_method or "env://")
    return init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)


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
    "start_shm_collective",
    "tp_groups_are_node_local",
]
