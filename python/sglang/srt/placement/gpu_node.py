"""Which NUMA node a GPU id belongs to, with sglang's preconditions for binding at all (upstream's helpers answer from here)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.engine_args import placement_view
from sglang.srt.placement.types import HostTopology

logger = logging.getLogger(__name__)

_ACCELERATOR_DEVICES = ("cuda", "xpu")


def host_topology() -> HostTopology:
    """This host's topology, from ``SGLANG_SYSFS_ROOT``."""
    from sglang.srt.placement.topology import read_topology

    return read_topology(settings.sysfs_root())


def numa_binding_possible(device: Optional[str], *, what: str, topology: HostTopology) -> bool:
    """Upstream's preconditions: an accelerator device, a second NUMA node, and numactl for the V2 path."""
    from sglang.srt.placement.numactl import find_numactl

    if (device or "cuda") not in _ACCELERATOR_DEVICES:
        logger.debug(f"{what}: device {device!r} is not an accelerator, no NUMA binding")
        return False
    if len(topology.cpu_nodes) < 2:
        logger.debug(f"{what}: this host has one NUMA node with CPUs, no NUMA binding")
        return False
    if settings.bind_v2() and find_numactl() is None:
        logger.debug(
            f"{what}: numactl command not found, skipping NUMA node configuration for GPU. Install numactl "
            "(e.g., apt-get install numactl) to enable automatic NUMA binding."
        )
        return False
    return True


def gpu_numa_node(server_args: Any, gpu_id: int) -> Optional[int]:
    """The NUMA node of GPU ``gpu_id``: ``--numa-node`` first, then discovery when SGLANG_AUTO_NUMA_BIND is on.

    Only ``server_args.numa_node`` is required of ``server_args``. None when
    discovery is off or not possible here (no accelerator device, one NUMA node,
    no numactl for the V2 path) or the device's node is unknown (the debug log
    says why).
    """
    numa_nodes = getattr(server_args, "numa_node", None)
    if numa_nodes is not None:
        if not 0 <= gpu_id < len(numa_nodes):
            raise ValueError(
                f"--numa-node has {len(numa_nodes)} entries but GPU {gpu_id} needs entry {gpu_id}: "
                f"give one NUMA node per GPU id, e.g. --numa-node {' '.join(['0'] * (gpu_id + 1))}"
            )
        return numa_nodes[gpu_id]
    if not settings.auto_numa_bind():
        return None
    topology = host_topology()
    if not numa_binding_possible(getattr(server_args, "device", None), what=f"GPU {gpu_id}", topology=topology):
        return None
    from sglang.srt.placement.resolve import device_numa_node

    view, _ = placement_view(server_args, gpu_id)
    choice = device_numa_node(view, gpu_id=gpu_id, topology=topology)
    if choice.node is None:
        logger.debug(f"GPU {gpu_id}: no NUMA node ({'; '.join(choice.reasons)})")
    return choice.node
