"""Per-rank distributed bootstrap (see ``bootstrap``). Importing this package does not import torch."""

from sglang.srt.distributed.shm_collective import (
    DistributedBootstrap,
    DistributedInitError,
    ShmNamespace,
    ShmNamespaceError,
    ShmOwnerError,
    StaleSweep,
    ThreadBindingError,
    bind_rank_threads,
    init_shm_collective,
    init_torch_distributed,
    release_shm_collective,
    remove_stale_segments,
    resolve_dist_init_method,
)

__all__ = [
    "DistributedBootstrap",
    "DistributedInitError",
    "ShmNamespace",
    "ShmNamespaceError",
    "ShmOwnerError",
    "StaleSweep",
    "ThreadBindingError",
    "bind_rank_threads",
    "init_shm_collective",
    "init_torch_distributed",
    "release_shm_collective",
    "remove_stale_segments",
    "resolve_dist_init_method",
]
