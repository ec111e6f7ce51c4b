"""The CPU shared-memory collective of one rank, its segments named by an explicit :class:`ShmNamespace`.

Bootstrap's ``_init_cpu_threads_env`` (AMX or arm64 hosts) calls
:func:`start_shm_collective` where upstream set ``MASTER_ADDR``/``MASTER_PORT``
and called ``sgl_kernel::initialize``, after setting ``LOCAL_SIZE`` as upstream
does (``parallel_state``'s ``GroupCoordinator`` reads it to turn the
shared-memory all-reduce on). ``ShmNamespace`` and the owners' API of
:mod:`~sglang.srt.distributed.shm_segments` are re-exported here, for the import
bootstrap gains (``from sglang.srt.distributed.bootstrap import ShmNamespace,
init_shm_collective``).

Kernel schemas
    ``initialize(int size, int rank) -> ()`` (the released CPU build) reads the
    names from the environment; it is called with ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``LOCAL_SIZE`` set for the call only, so ``MASTER_ADDR``
    and ``MASTER_PORT`` are as before afterwards.
    ``initialize(int size, int rank, str namespace) -> ()`` takes the segment
    prefix (``ShmNamespace.prefix``: the whole name up to ``_<rank>``), appends
    ``_<rank>`` for each rank's segment, and treats all ``size`` ranks as local.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator, Mapping, Optional

from sglang.srt.distributed.shm_errors import (
    SHM_DIR,
    ShmCollectiveError,
    ensure_segment_space,
)
from sglang.srt.distributed.shm_namespace import (
    NAME_MAX,
    ShmNamespace,
    ShmNamespaceError,
    quoted,
)
from sglang.srt.distributed.shm_segments import (
    claim_segment,
    release_shm_collective,
    remove_stale_segments,
)

logger = logging.getLogger(__name__)

# os.environ is process-wide: two threads scoping the same names would restore
# each other's values, so every scoped change holds this lock for its block.
_SCOPED_ENVIRON_LOCK = threading.RLock()


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in the process environment for the ``with`` block only, then put
    back the previous values (or their absence), also on error."""
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


def init_shm_collective(
    namespace: ShmNamespace,
    *,
    tp_size: int,
    tp_rank: int,
    shm_dir: str = SHM_DIR,
    owner_wait_s: float = 10.0,
) -> bool:
    """Initialise the CPU shared-memory collective of rank ``tp_rank`` in ``namespace``.

    Returns True if ``sgl_kernel::initialize`` was called, False (one DEBUG line) if no
    such op is registered. Before the call this rank claims its segment
    (:func:`~sglang.srt.distributed.shm_segments.claim_segment`) and checks that
    ``shm_dir`` has room for the segments its engine has still to write.
    """
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ShmNamespaceError(f"{name}={quoted(value)}: expected an integer")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ShmNamespaceError(
            f"tp_rank={tp_rank}, tp_size={tp_size}: expected 0 <= tp_rank < tp_size "
            f"(--tp-size sets tp_size)"
        )
    # The kernel package is never imported here: whoever wants the CPU kernel
    # imports it first.
    op = None
    with contextlib.suppress(ImportError):
        import torch

        with contextlib.suppress(AttributeError, RuntimeError):
            op = torch.ops.sgl_kernel.initialize
    if op is None:
        logger.debug(
            f"rank {tp_rank}: no sgl_kernel::initialize op is registered; "
            f"the CPU shared-memory collective is not set up"
        )
        return False
    schema = op.default._schema
    types = tuple(str(argument.type) for argument in schema.arguments)
    kind = {("int", "int"): "released", ("int", "int", "str"): "namespaced"}.get(types)
    if kind is None:
        raise ShmCollectiveError(
            f"sgl_kernel::initialize has schema {schema}; expected initialize(int "
            f"size, int rank) or initialize(int size, int rank, str namespace): "
            f"install the sgl-kernel CPU build that matches this sglang"
        )

    claim_segment(namespace, rank=tp_rank, shm_dir=shm_dir, wait_s=owner_wait_s)
    try:
        ensure_segment_space(namespace, rank=tp_rank, tp_size=tp_size, shm_dir=shm_dir)
        if kind == "namespaced":
            op(tp_size, tp_rank, namespace.prefix)
        else:
            with scoped_environ(
                {
                    "MASTER_ADDR": namespace.kernel_addr,
                    "MASTER_PORT": str(namespace.port),
                    "LOCAL_SIZE": str(tp_size),
                }
            ):
                op(tp_size, tp_rank)
    except BaseException:
        release_shm_collective(namespace, rank=tp_rank)
        raise
    logger.info(
        f"rank {tp_rank}: CPU shared-memory collective initialised (segment "
        f"{namespace.segment_name(tp_rank)}, tp_size={tp_size}, {kind} kernel schema)"
    )
    return True


def start_shm_collective(
    *,
    dist_init_method: Optional[str],
    tp_size: int,
    tp_rank: int,
    pp_rank: int,
) -> bool:
    """Bootstrap's CPU path: :func:`init_shm_collective` in the namespace of the
    engine's own init method and this rank's pipeline stage (each stage of an engine
    gets its own segments, ``<addr>@pp<k>``)."""
    namespace = ShmNamespace.from_init_method(
        dist_init_method or "env://", pp_rank=pp_rank
    )
    return init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)


__all__ = [
    "NAME_MAX",
    "ShmCollectiveError",
    "ShmNamespace",
    "ShmNamespaceError",
    "init_shm_collective",
    "release_shm_collective",
    "remove_stale_segments",
    "scoped_environ",
    "start_shm_collective",
]
