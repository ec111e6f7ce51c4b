"""SGLANG_SET_CPU_AFFINITY: which CPUs of its node a rank gets. The node's GPUs split
its allowed physical cores (with their SMT siblings) into even contiguous slices, by
each GPU's place among them; without a node, upstream's NUMA-blind slice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang.srt.placement.cpulist import format_cpulist


@dataclass(frozen=True)
class Slot:  # a GPU's place among the GPUs that share its node
    index: int
    count: int
    why: str  # "GPU 2 of 2 on node 1 (PCI order)"


@dataclass(frozen=True)
class Share:  # the CPUs of its node a rank gets
    cpus: frozenset[int]
    whole: bool  # every CPU of the node: numactl's --cpunodebind
    reasons: tuple[str, ...] = ()
    degraded: bool = False


def node_share(
    *,
    node: int,
    node_cpus: frozenset[int],
    allowed: frozenset[int],
    cores: Optional[list[frozenset[int]]] = None,
    slot: Optional[Slot] = None,
) -> Share:
    """The node's allowed CPUs, or with ``slot`` its slice of ``cores`` (the allowed
    ones, each with its allowed siblings); empty when none is allowed."""
    cpus = node_cpus & allowed
    whole = cpus == node_cpus  # a node without CPUs too: numactl decides
    if not cpus or slot is None or cores is None:
        return Share(cpus, whole)
    head = (
        f"SGLANG_SET_CPU_AFFINITY=1: {slot.why} gets slice {slot.index + 1} of "
        f"{slot.count} of node {node}'s {len(cores)} allowed cores"
    )
    if len(cores) < slot.count and len(cores) < sum(map(len, cores)):
        cores = [frozenset([cpu]) for core in cores for cpu in sorted(core)]
        head += "; fewer cores than GPUs: slices split SMT siblings"
    if len(cores) < slot.count:
        why = f"node {node} has {len(cores)} allowed CPUs for {slot.count} GPUs"
        mine = cores[slot.index % len(cores)]
        return Share(mine, False, (head, f"{why}: GPUs share CPUs"), degraded=True)
    size, extra = divmod(len(cores), slot.count)
    start = slot.index * size + min(slot.index, extra)
    mine = frozenset().union(*cores[start : start + size + (slot.index < extra)])
    return Share(mine, mine == node_cpus, (head,))


def upstream_slice(
    index: int, *, tp_per_node: int, physical_cores: int, logical_cpus: int
) -> frozenset[int]:
    """``set_gpu_proc_affinity(index)``'s CPUs: ``cores // tp_per_node`` physical cores
    from ``index`` times that (modulo the cores), and with SMT their siblings numbered
    ``cores`` higher; NUMA-blind."""
    per = physical_cores // max(tp_per_node, 1)
    start = (index * per) % physical_cores if physical_cores else 0
    cpus = set(range(start, start + per))
    if logical_cpus != physical_cores:
        cpus |= {cpu + physical_cores for cpu in cpus}
    return frozenset(cpus)


def upstream_slice_reason(index: int, cpus: frozenset[int]) -> str:
    return (
        f"SGLANG_SET_CPU_AFFINITY=1 without a NUMA node: upstream's NUMA-blind slice "
        f"for gpu_id {index}, CPUs {format_cpulist(cpus) or '(none)'} "
        "(set_gpu_proc_affinity's rule), applied in configure_scheduler_process"
    )
