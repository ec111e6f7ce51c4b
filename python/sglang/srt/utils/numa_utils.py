"""sglang's NUMA helpers (``configure_subprocess``, ``numa_bind_to_node``, ...), kept by name and meaning, answered by placement.

Upstream's callers drive these: the engine and the data-parallel controller
wrap each scheduler ``proc.start()`` in ``configure_subprocess(server_args,
gpu_id)``; the scheduler (legacy V1 path) and the diffusion GPU worker call
``get_numa_node_if_available`` then ``numa_bind_to_node``; bootstrap's CPU
path calls ``init_threads_binding``. Each answer comes from the one placement
of that GPU's rank (``sglang.srt.placement``).

``configure_subprocess`` writes no wrapper script and never swaps the
process-global spawn executable: a child spawned inside the block starts under
numactl through the thread-local spawn hook (``scheduler_launch.spawn_hook``).

This module imports nothing heavy when it loads: placement and the launch
pieces are imported where they are used.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing.spawn
import os
from typing import Any, Iterator, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.engine_args import placement_for_gpu
from sglang.srt.placement.gpu_node import gpu_numa_node, host_topology, numa_binding_possible
from sglang.srt.placement.types import PlacementError, ProcessPlacement, Strategy

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def configure_subprocess(
    server_args: Any, gpu_id: int, *, placement: Optional[ProcessPlacement] = None
) -> Iterator[None]:
    """Wrap ``Process.start()``: a spawned child started in the block runs under its GPU's placement.

    As upstream, nothing happens when ``SGLANG_NUMA_BIND_V2=0`` (the child binds
    itself), for a device that is not CUDA or XPU, on a host with one NUMA
    node, without numactl, or when the placement for ``gpu_id`` does not bind.
    Only the calling thread is affected and everything is restored on exit.
    """
    if not settings.bind_v2():
        yield
        return
    if placement is None:
        # One read of this host's topology serves the preconditions and the placement.
        topology = host_topology()
        if not numa_binding_possible(getattr(server_args, "device", None), what=f"GPU {gpu_id}", topology=topology):
            yield
            return
        placement = placement_for_gpu(server_args, gpu_id, topology=topology)
    if placement.strategy != Strategy.EXEC:
        logger.debug(f"GPU {gpu_id}: placement strategy {placement.strategy}, nothing to wrap around the spawn")
        yield
        return

    from sglang.srt.placement.numactl import numactl_prefix
    from sglang.srt.scheduler_launch.spawn_hook import spawn_hook_installed, spawn_with_prefix

    prefix = numactl_prefix(placement)
    executable_before = os.fsdecode(multiprocessing.spawn.get_executable())
    logger.debug(f"GPU {gpu_id}: spawning under {' '.join(prefix)} (spawn executable {executable_before})")
    failed = False
    with spawn_with_prefix(prefix) as use:
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            problems = _spawn_state_problems(executable_before=executable_before, hook_installed=spawn_hook_installed())
            if not problems and use.applied == 0 and not failed:
                problems.append(
                    "no process was started with the spawn start method inside the block, so numactl "
                    f"{' '.join(prefix[1:])} was not applied (use multiprocessing.get_context('spawn'))"
                )
            if problems:
                message = f"configure_subprocess(gpu_id={gpu_id}): " + "; ".join(problems)
                if settings.bind_failure_is_fatal() and not failed:
                    raise PlacementError(message)
                logger.warning(message)


def _spawn_state_problems(*, executable_before: str, hook_installed: bool) -> list[str]:
    problems = []
    executable_after = os.fsdecode(multiprocessing.spawn.get_executable())
    if executable_after != executable_before:
        problems.append(
            f"the multiprocessing spawn executable changed from {executable_before} to {executable_after} while "
            "the block ran (another library called multiprocessing.set_executable); children may run another interpreter"
        )
    if not hook_installed:
        problems.append(
            "multiprocessing.util.spawnv_passfds was replaced by other code while the block ran; "
            "children started in it may not be under numactl"
        )
    return problems


def numa_bind_to_node(node: int) -> None:
    """Bind the calling process to ``node``'s allowed CPUs, preferring its memory where the policy may be set.

    A node this host lacks, or one whose CPUs the current affinity excludes,
    goes to the failure policy (a warning, or an error under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1); without libnuma this is a warning.
    """
    from sglang.srt.placement.apply import bind_legacy_v1

    bind_legacy_v1(node)


def get_numa_node_if_available(server_args: Any, gpu_id: int) -> Optional[int]:
    """The NUMA node of GPU ``gpu_id`` (``--numa-node``, else discovery), or None: see ``placement.gpu_node``."""
    return gpu_numa_node(server_args, gpu_id)


def get_libnuma() -> Optional[ctypes.CDLL]:
    """The loaded libnuma (a ``ctypes.CDLL``), or None when it is not installed or NUMA is unavailable."""
    from sglang.srt.placement.libnuma import load_libnuma

    for name in ("libnuma.so", "libnuma.so.1"):
        loaded = load_libnuma(name=name)
        if loaded is not None:
            return loaded.cdll
    return None


def init_threads_binding(*, numa_index: int, world_size: int) -> str:
    """The CPU list of a CPU-device rank's OpenMP threads, from SGLANG_CPU_OMP_THREADS_BIND or its NUMA node.

    With ``all`` (the default) rank ``numa_index`` gets one CPU per physical
    core of the ``numa_index``-th node with CPUs, as upstream: SMT siblings
    are left out, so OpenMP runs one thread per core.
    """
    local_omp_cpuid = _rank_cpulist(numa_index=numa_index, world_size=world_size)
    logger.info(
        f"init_threads_binding: numa_index={numa_index}, world_size={world_size}, local_omp_cpuid={local_omp_cpuid}"
    )
    return local_omp_cpuid


def _rank_cpulist(*, numa_index: int, world_size: int) -> str:
    """The index-th ``|`` group of SGLANG_CPU_OMP_THREADS_BIND, or with ``all`` the index-th node's physical cores."""
    from sglang.srt.placement.cpulist import format_cpulist
    from sglang.srt.placement.resolve import cpu_rank_cpus
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    setting = settings.cpu_threads_bind()
    topology = read_topology(settings.sysfs_root())
    affinity = read_process_affinity()
    if setting == "all":
        n_nodes = len(topology.cpu_nodes)
        if not 0 <= numa_index < n_nodes:
            raise PlacementError(
                f"rank index {numa_index} (of {world_size} ranks) has no NUMA node: this host has {n_nodes} node(s) "
                "with CPUs; use fewer ranks, or set SGLANG_CPU_OMP_THREADS_BIND to one '|'-separated CPU group per "
                "rank, e.g. SGLANG_CPU_OMP_THREADS_BIND='0-15|16-31'"
            )
        if world_size < n_nodes:
            logger.warning(
                f"this host has {n_nodes} NUMA nodes but the engine has {world_size} ranks, so only {world_size} "
                "nodes are used"
            )
        cpus = topology.one_cpu_per_core(
            cpu_rank_cpus(setting, index=numa_index, world_size=n_nodes, topology=topology, affinity=affinity)
        )
    else:
        # Bounded by the groups, not world_size: a router runs each DP worker as its own engine of one rank
        # whose numa_index still counts across the whole bind string.
        groups = setting.split("|")
        if not 0 <= numa_index < len(groups):
            raise PlacementError(
                f"SGLANG_CPU_OMP_THREADS_BIND={setting!r} has {len(groups)} group(s) but rank index {numa_index} "
                "needs one more: give one '|'-separated CPU group per rank (dp_size x tp_size x pp_size)"
            )
        cpus = cpu_rank_cpus(setting, index=numa_index, world_size=len(groups), topology=topology, affinity=affinity)
    if not cpus:
        raise PlacementError(
            f"rank index {numa_index}: none of its CPUs may be used by this process "
            f"(allowed: {format_cpulist(affinity.cpus)}); adjust SGLANG_CPU_OMP_THREADS_BIND or the cpuset"
        )
    return format_cpulist(cpus)
