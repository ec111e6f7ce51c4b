"""Upstream's NUMA helpers, kept by name and meaning, answered by the placement subsystem.

``configure_subprocess`` no longer writes a wrapper script or swaps the
process-global spawn executable: a child spawned inside the block starts under
numactl through the thread-local spawn hook of ``entrypoints/engine.py``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.spawn
import os
from typing import Any, Iterator, Optional

from sglang.srt.environ import envs
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import PlacementError, ProcessPlacement, Strategy

logger = logging.getLogger(__name__)


def _resolve_for_gpu(server_args: Any, gpu_id: int) -> ProcessPlacement:
    from sglang.srt.placement.resolve import rank_of_gpu, resolve_rank

    rank = rank_of_gpu(server_args, gpu_id)
    return resolve_rank(server_args, dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank,
                        gpu_id=gpu_id, launcher="mp")


@contextlib.contextmanager
def configure_subprocess(
    server_args: Any, gpu_id: int, *, placement: Optional[ProcessPlacement] = None
) -> Iterator[None]:
    """Wrap ``Process.start()``: a spawned child started in the block runs under its GPU's placement.

    As upstream, nothing happens when ``SGLANG_NUMA_BIND_V2=0`` (the child binds
    itself) or when the placement for ``gpu_id`` does not bind. Only the calling
    thread is affected and everything is restored on exit, error or not.
    """
    if not envs.SGLANG_NUMA_BIND_V2.get():
        yield
        return
    if placement is None:
        placement = _resolve_for_gpu(server_args, gpu_id)
    if placement.strategy != Strategy.EXEC:
        logger.debug(f"GPU {gpu_id}: placement strategy {placement.strategy!r}, nothing to wrap around the spawn")
        yield
        return

    from sglang.srt.scheduler_launch.spawn_hook import spawn_hook_installed, spawn_with_prefix
    from sglang.srt.placement.numactl import numactl_prefix

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
                if envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.get() and not failed:
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
    """Legacy (V1) in-child bind of the calling process to ``node``'s CPUs, preferring its memory."""
    from sglang.srt.placement.apply import bind_legacy_v1

    bind_legacy_v1(node)


def get_numa_node_if_available(server_args: Any, gpu_id: int) -> Optional[int]:
    """The NUMA node of GPU ``gpu_id``: ``--numa-node`` first, then discovery when SGLANG_AUTO_NUMA_BIND is on.

    None when the device's node is unknown (no PCI address, or the kernel reports -1);
    the debug log says why.
    """
    numa_nodes = getattr(server_args, "numa_node", None)
    if numa_nodes is not None:
        if not 0 <= gpu_id < len(numa_nodes):
            raise ValueError(
                f"--numa-node has {len(numa_nodes)} entries but GPU {gpu_id} needs entry {gpu_id}: "
                f"give one NUMA node per GPU id, e.g. --numa-node {' '.join(['0'] * (gpu_id + 1))}"
            )
        return numa_nodes[gpu_id]
    if not envs.SGLANG_AUTO_NUMA_BIND.get():
        return None
    from sglang.srt.placement.resolve import device_numa_node

    choice = device_numa_node(server_args, gpu_id=gpu_id)
    if choice.node is None:
        logger.debug(f"GPU {gpu_id}: no NUMA node ({'; '.join(choice.reasons)})")
    return choice.node


def get_libnuma() -> Any:
    """The process's libnuma binding, or None when libnuma is not installed."""
    from sglang.srt.placement.libnuma import load_libnuma

    return load_libnuma()


def init_threads_binding(*, numa_index: int, world_size: int) -> str:
    """The CPU list of a CPU-device rank's OpenMP threads, from SGLANG_CPU_OMP_THREADS_BIND or its NUMA node."""
    local_omp_cpuid = _rank_cpulist(numa_index=numa_index, world_size=world_size)
    logger.info(
        f"init_threads_binding: numa_index={numa_index}, world_size={world_size}, local_omp_cpuid={local_omp_cpuid}"
    )
    return local_omp_cpuid


def _rank_cpulist(*, numa_index: int, world_size: int) -> str:
    """The index-th ``|`` group of SGLANG_CPU_OMP_THREADS_BIND, or with ``all`` the index-th NUMA node's CPUs."""
    from sglang.srt.placement.resolve import cpu_rank_cpus
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    setting = envs.SGLANG_CPU_OMP_THREADS_BIND.get()
    topology = read_topology(envs.SGLANG_SYSFS_ROOT.get())
    affinity = read_process_affinity()
    if setting.strip() == "all":
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
        cpus = cpu_rank_cpus(setting, index=numa_index, world_size=world_size, topology=topology, affinity=affinity)
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
