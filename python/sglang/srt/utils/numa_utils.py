"""sglang's NUMA helpers, kept by name and meaning, answered by sglang.srt.placement.

Upstream's callers drive these: the engine and the data-parallel controller
wrap each scheduler ``proc.start()`` in ``configure_subprocess(server_args,
gpu_id)``; the scheduler (legacy V1 path), the Ray scheduler actor and the
diffusion GPU worker call ``get_numa_node_if_available`` then
``numa_bind_to_node``; bootstrap's CPU path calls ``init_threads_binding``.

``configure_subprocess`` places the GPU id it is given, under the
``CUDA_VISIBLE_DEVICES`` in force, and starts the child under numactl through a
thread-local spawn hook: no wrapper script, and the process-global spawn
executable is never swapped. CPU-device ranks are placed there too, from
``SGLANG_CPU_OMP_THREADS_BIND`` (upstream leaves them unbound until bootstrap).

The private helpers ``_is_cuda``, ``_is_xpu``, ``_is_numa_available``,
``_query_numa_node_for_gpu``, ``_can_set_mempolicy``, ``_node_cpus``,
``_handle_numa_bind_failure`` and ``_log_cpu_only_binding`` keep upstream's
names and meanings because upstream's own tests (and the diffusion worker's)
patch them. Loading this module does not initialise a device runtime:
``_is_cuda`` and ``_is_xpu`` are worked out on first use (None until then).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil  # noqa: F401 - upstream's tests patch numa_utils.shutil.which
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from sglang.srt.placement import settings

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Upstream computes these at import, where is_cuda()/is_xpu() import torch and ask the
# driver; here on first use.
_is_cuda: Optional[bool] = None
_is_xpu: Optional[bool] = None


def _platform_flag(name: str) -> bool:
    if globals()[name] is None:
        from sglang.srt.utils.common import is_cuda, is_xpu

        globals()[name] = bool(is_cuda() if name == "_is_cuda" else is_xpu())
    return bool(globals()[name])


@contextlib.contextmanager
def configure_subprocess(server_args: "ServerArgs", gpu_id: int) -> Iterator[None]:
    """Wrap ``Process.start()``: a child spawned in the block runs under the placement
    of ``gpu_id``.

    The placement and the failure policy are settled at entry, before anything
    starts: a rank that would be less bound than intended gets a WARNING, or an
    error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1. As upstream, nothing is
    done with SGLANG_NUMA_BIND_V2=0 (the child binds itself), for a device that
    is not CUDA, XPU or CPU, on a one-node GPU host, or without numactl. Only
    the calling thread is affected and everything is restored on exit.
    """
    from sglang.srt.scheduler_placement.spawn import placed_spawn

    with placed_spawn(server_args, gpu_id):
        yield


def get_numa_node_if_available(server_args: "ServerArgs", gpu_id: int) -> Optional[int]:
    """The NUMA node of GPU ``gpu_id``: ``--numa-node`` first, else the node of the
    device that ``gpu_id`` names under the ``CUDA_VISIBLE_DEVICES`` or
    ``ZE_AFFINITY_MASK`` in force; None when discovery is off, not possible here, or
    finds nothing."""
    numa_nodes = getattr(server_args, "numa_node", None)
    if numa_nodes is not None:
        if not 0 <= gpu_id < len(numa_nodes):
            raise ValueError(
                f"--numa-node has {len(numa_nodes)} entries but GPU {gpu_id} needs "
                f"entry {gpu_id}: give one NUMA node per GPU id, e.g. --numa-node "
                + " ".join(["0"] * (gpu_id + 1))
            )
        return numa_nodes[gpu_id]
    if not settings.auto_numa_bind():
        return None
    if not _is_numa_available():
        return None
    nodes = _query_numa_node_for_gpu(gpu_id)
    if not nodes:
        return None
    if len(nodes) > 1:
        # Upstream's wording, which operators search for.
        logger.warning(
            f"Multiple NUMA nodes found for GPU {gpu_id}: {nodes}. Using the first one."
        )
    return nodes[0]


def get_libnuma() -> Optional[ctypes.CDLL]:
    """The loaded libnuma (a ``ctypes.CDLL``), or None when it cannot be loaded or the
    kernel refuses NUMA calls; placement's one loader answers."""
    from sglang.srt.placement.libnuma import load_libnuma

    lib = load_libnuma()
    return None if lib is None else lib.cdll


def numa_bind_to_node(node: int) -> None:
    """Bind the calling process to ``node``: its CPUs that the current affinity allows,
    and its memory as the preferred node where the memory policy may be set.

    As upstream, with two deliberate differences: every thread of the process is
    moved, not only the calling one (a pool started by an import would stay
    unbound), and the pages touched so far migrate to the node. A missing libnuma,
    a node this host lacks, or a node whose CPUs the affinity excludes goes to the
    failure policy: a warning, or an error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
    """
    from sglang.srt.placement.apply import bind_in_process
    from sglang.srt.placement.types import (
        MemPolicy,
        ProcessPlacement,
        RankIdentity,
        Strategy,
    )

    libnuma = get_libnuma()
    if libnuma is None or libnuma.numa_available() < 0:
        _handle_numa_bind_failure(
            node, reason="numa not available on this system, skip bind action"
        )
        return
    found = _host_topology().node(node)
    if found is None:
        reason = f"NUMA node {node} does not exist on this host, skipping NUMA binding."
        _handle_numa_bind_failure(node, reason=reason)
        return
    node_cpus = set(found.cpus)
    allowed = os.sched_getaffinity(0)
    if node_cpus and not node_cpus & allowed:
        _handle_numa_bind_failure(node, allowed)
        return
    # Where the memory policy may not be set, CPU affinity alone keeps first-touch
    # allocations local; a node without CPUs leaves the affinity as it is.
    memory = _can_set_mempolicy()
    if not memory:
        _log_cpu_only_binding(node)
    placement = ProcessPlacement(
        RankIdentity(None, None, None, None),
        numa_node=node,
        cpus=frozenset(node_cpus & allowed),
        mem_nodes=frozenset([node] if memory else []),
        mem_policy=MemPolicy.PREFERRED if memory else MemPolicy.NONE,
        strategy=Strategy.V1,
    )
    bind_in_process(placement)


def init_threads_binding(*, numa_index: int, world_size: int) -> str:
    """The CPUs of a CPU-device rank's OpenMP threads, from SGLANG_CPU_OMP_THREADS_BIND.

    With ``all`` (the default) rank ``numa_index`` gets one CPU per physical
    core of the ``numa_index``-th node with CPUs, as upstream, comma-separated;
    otherwise its ``|`` group as written. The group count bounds the index (a
    router runs each worker as an engine of one rank whose index counts across
    the setting). Groups may share CPUs, with a warning; ``plan`` reads the
    setting the same way.
    """
    from sglang.srt.placement.settings import rank_cpus, shared_cpus
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    setting = settings.cpu_threads_bind()
    topology, affinity = read_topology(settings.sysfs_root()), read_process_affinity()
    n_nodes = len(topology.cpu_nodes_within(affinity.cpus))  # as get_cpu_ids_by_node
    cpus = rank_cpus(setting, index=numa_index, topology=topology, affinity=affinity)
    if setting == "all":
        if world_size < n_nodes:
            logger.warning(
                f"Detected the current machine has {n_nodes} numa nodes available, but "
                f"the total number of ranks (dp_size * tp_size * pp_size) is "
                f"{world_size}, so only {world_size} numa nodes are used."
            )
        one_per_core = {min(topology.core_of(cpu) & cpus) for cpu in cpus}
        local_omp_cpuid = ",".join(map(str, sorted(one_per_core)))
    else:
        local_omp_cpuid = setting.split("|")[numa_index].strip()
        if world_size > n_nodes:
            logger.warning(
                f"The total number of ranks ({world_size}) is larger than numa node "
                f"number ({n_nodes}), in this case the available memory amount of each "
                "rank cannot be determined in prior. Please set proper "
                "`--max-total-tokens` to avoid the out-of-memory error."
            )
        note = shared_cpus(setting, index=numa_index)
        if note is not None:
            logger.warning(note)
    logger.info(
        f"init_threads_binding: numa_index={numa_index}, world_size={world_size}, "
        f"local_omp_cpuid={local_omp_cpuid}"
    )
    return local_omp_cpuid


# -- upstream's private helpers ---------------------------------------------------


def _log_cpu_only_binding(node: int) -> None:
    logger.info(
        f"NUMA memory policy not permitted; binding CPUs only to NUMA node {node}. "
        "If using docker, --cap-add SYS_NICE also binds host memory."
    )


def _host_topology():
    from sglang.srt.placement.topology import read_topology_cached

    # One read serves the GPU's node, its CPUs and whether it exists.
    return read_topology_cached(settings.sysfs_root())


def _node_cpus(node: int) -> set:
    """The online CPUs of ``node`` (none for a node without CPUs or one not here)."""
    found = _host_topology().node(node)
    return set(found.cpus) if found is not None else set()


def _handle_numa_bind_failure(
    node: int,
    allowed_cpus: Optional[Iterable[int]] = None,
    gpu_id: Optional[int] = None,
    *,
    reason: Optional[str] = None,
) -> None:
    """Upstream's failure policy: warn, or raise (``RuntimeError``) under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.

    Without ``reason`` the failure is an empty CPU intersection and the message
    names ``allowed_cpus``, in upstream's words.
    """
    from sglang.srt.placement.apply import handle_bind_failure

    if reason is None:
        for_gpu = f" for GPU {gpu_id}" if gpu_id is not None else ""
        reason = (
            f"NUMA node {node} has no CPU cores allowed by the current affinity "
            f"{sorted(allowed_cpus or ())}, skipping NUMA binding{for_gpu}."
        )
    handle_bind_failure(reason, log=logger)


def _can_set_mempolicy() -> bool:
    """Whether this process may use the memory-policy calls (a container without
    SYS_NICE may not)."""
    from sglang.srt.placement.libnuma import read_mempolicy

    try:
        read_mempolicy()
    except OSError:
        return False
    return True


def _is_numa_available() -> bool:
    """Upstream's preconditions for discovery: a CUDA or XPU platform, a node 1, and
    numactl for the V2 path.

    A host where only CPU affinity can be set (a container without SYS_NICE) counts.
    """
    if not (_platform_flag("_is_cuda") or _platform_flag("_is_xpu")):
        return False
    if not os.path.isdir(
        os.path.join(settings.sysfs_root(), "devices/system/node/node1")
    ):
        return False
    from sglang.srt.placement.numactl import find_numactl

    if find_numactl() is None and settings.bind_v2():
        logger.debug(
            "numactl command not found, skipping NUMA node configuration for GPU. "
            "Install numactl "
            "(e.g., apt-get install numactl) to enable automatic NUMA binding."
        )
        return False
    return True


def _query_numa_node_for_gpu(device_id: int) -> list[int]:
    """The NUMA node(s) of logical device ``device_id``: the node of its PCI address,
    found through the visibility variable in force (``CUDA_VISIBLE_DEVICES``,
    ``ZE_AFFINITY_MASK``) and NVML when present.
    """
    from sglang.srt.placement.resolve import device_node

    device = (
        "xpu"
        if _platform_flag("_is_xpu") and not _platform_flag("_is_cuda")
        else "cuda"
    )
    env = settings.device_env()
    where = device_node(device_id, device=device, topology=_host_topology(), env=env)
    if where.node_id is None:
        logger.warning(
            f"GPU {device_id}: no NUMA node ({'; '.join(where.reasons)}), skipping "
            "NUMA node configuration for GPU"
        )
        return []
    return [where.node_id]
