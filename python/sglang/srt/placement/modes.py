"""SGLANG_NUMA_AFFINITY_MODE: which CPUs of its GPU's node (or package) a rank gets,
one function per mode. Each rank decides alone, from sysfs, so a spawned child, a Ray
actor and ``plan`` give a GPU the same CPUs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, Optional

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.devices import accelerator_pci_devices
from sglang.srt.placement.types import (
    HostTopology,
    NumaNode,
    ProcessAffinity,
    SettingError,
)


class AffinityMode(enum.StrEnum):
    NODE = "node"  # the GPU's node
    EXCLUSIVE = "exclusive"  # the GPU's slice of its node's cores
    SOCKET = "socket"  # every node of the GPU's package
    CORE_COMPLEX = "core-complex"  # one L3 group of its node

    @classmethod
    def parse(cls, value: object, *, setting: str) -> "AffinityMode":
        try:
            return cls(str(value).strip())
        except ValueError:
            choices = ", ".join(mode.value for mode in cls)
            raise SettingError(
                f"{setting}={value!r} is not valid: choose one of {choices}"
            ) from None

    @property
    def shares_node(self) -> bool:  # the node's GPUs split its CPUs between them
        return self in (AffinityMode.EXCLUSIVE, AffinityMode.CORE_COMPLEX)

    @property
    def idle_on_one_node(self) -> bool:  # binding all of a one-node host cannot help
        return self is AffinityMode.NODE

    def share(self, gpu: GpuNode) -> Share:  # what this mode gives the GPU
        return _MODES[self](gpu)


@dataclass(frozen=True)
class GpuNode:  # a GPU placed on ``node``: what a mode decides from
    topology: HostTopology
    node: NumaNode
    affinity: ProcessAffinity  # the CPUs this process may use
    pci: Optional[str]
    device: str


@dataclass(frozen=True)
class Share:
    cpus: frozenset[int]  # empty: none of the node's CPUs is allowed
    nodes: tuple[NumaNode, ...]  # where its memory goes
    reasons: tuple[str, ...] = ()
    degraded: bool = False
    whole: bool = False  # every CPU of ``nodes``: numactl's --cpunodebind


def _whole(gpu: GpuNode, nodes: tuple[NumaNode, ...], *reasons: str) -> Share:
    span = frozenset().union(*(n.cpus for n in nodes))
    cpus = span & gpu.affinity.cpus
    if cpus and cpus != span:
        reasons += (
            f"{gpu.affinity.source} allows {len(cpus)} of {len(span)} CPUs of node(s) "
            f"{format_cpulist(n.node_id for n in nodes)}",
        )
    return Share(cpus, nodes, reasons, whole=cpus == span)


def _node(gpu: GpuNode) -> Share:
    return _whole(gpu, (gpu.node,))


def _socket(gpu: GpuNode) -> Share:
    cpus = gpu.topology.cpus
    packages = {c.package_id for c in cpus if c.node_id == gpu.node.node_id}
    held = {c.node_id for c in cpus if c.package_id in packages} - {None}
    node_ids = sorted(held) or [gpu.node.node_id]
    nodes = tuple(n for n in map(gpu.topology.node, node_ids) if n is not None)
    why = (
        f"socket mode: package {format_cpulist(packages)} holds node(s) "
        f"{format_cpulist(node_ids)}"
    )
    return _whole(gpu, nodes, why)


def _node_gpus(gpu: GpuNode) -> list[str]:  # in PCI order
    devices = accelerator_pci_devices(gpu.topology, device=gpu.device)
    return [d.address for d in devices if gpu.topology.node_of(d) == gpu.node.node_id]


def _shared(
    mode: AffinityMode, split: Callable[[GpuNode, Share, str, int, int], Share]
) -> Callable[[GpuNode], Share]:
    """A mode that gives the GPU its share of the node by its index among the node's
    GPUs; the whole node, with the reason, where the GPU is not among them."""

    def decide(gpu: GpuNode) -> Share:
        node, gpus = _node(gpu), _node_gpus(gpu)
        if not node.cpus:
            return node
        if gpu.pci not in gpus:
            return _whole_node(
                node,
                f"{mode} mode: GPU {gpu.pci or '(no PCI address)'} is not among node "
                f"{gpu.node.node_id}'s {gpu.device} devices in sysfs "
                f"({', '.join(gpus) or 'none'})",
            )
        index, count = gpus.index(gpu.pci), len(gpus)
        gets = (
            f"{mode} mode: GPU {index + 1} of {count} on node {gpu.node.node_id} "
            "(PCI order) gets"
        )
        return split(gpu, node, gets, index, count)

    return decide


def _whole_node(node: Share, why: str) -> Share:
    reasons = (*node.reasons, f"{why}: bound to the whole node")
    return replace(node, reasons=reasons, degraded=True)


def _l3_group(gpu: GpuNode, node: Share, gets: str, index: int, count: int) -> Share:
    infos = [gpu.topology.cpu(cpu_id) for cpu_id in sorted(node.cpus)]
    if any(info is None or info.l3_cpus is None for info in infos):
        why = f"no L3 groups (cache/index3) for node {gpu.node.node_id}'s CPUs"
        return _whole_node(node, f"core-complex mode: sysfs has {why}")
    groups = sorted({info.l3_cpus & node.cpus for info in infos}, key=min)
    chosen = index % len(groups)
    reasons = (f"{gets} L3 group {chosen + 1} of {len(groups)}",)
    if count > len(groups):
        reasons += (
            f"node {gpu.node.node_id} has {count} GPUs for {len(groups)} L3 groups: "
            "GPUs wrap round and share a group",
        )
    return Share(groups[chosen], node.nodes, node.reasons + reasons)


def _core_slice(gpu: GpuNode, node: Share, gets: str, index: int, count: int) -> Share:
    """A contiguous slice of whole cores, sizes as even as possible; GPUs beyond the
    cores split SMT siblings, then share CPUs."""
    cores = sorted({gpu.topology.core_of(c) & node.cpus for c in node.cpus}, key=min)
    reasons = node.reasons + (
        f"{gets} slice {index + 1} of the node's {len(cores)} allowed cores",
    )
    if len(cores) < count:
        cores = [frozenset({cpu}) for core in cores for cpu in sorted(core)]
        reasons += (
            f"node {gpu.node.node_id} has fewer allowed cores than GPUs: slices "
            "split SMT siblings",
        )
    if len(cores) < count:
        reasons += (
            f"node {gpu.node.node_id} has {len(cores)} allowed CPUs for {count} "
            "GPUs: GPUs share CPUs",
        )
        return Share(cores[index % len(cores)], node.nodes, reasons, degraded=True)
    size, extra = divmod(len(cores), count)
    start = index * size + min(index, extra)
    cpus = frozenset().union(*cores[start : start + size + (index < extra)])
    return Share(cpus, node.nodes, reasons)


_MODES: dict[AffinityMode, Callable[[GpuNode], Share]] = {
    AffinityMode.NODE: _node,
    AffinityMode.SOCKET: _socket,
    AffinityMode.EXCLUSIVE: _shared(AffinityMode.EXCLUSIVE, _core_slice),
    AffinityMode.CORE_COMPLEX: _shared(AffinityMode.CORE_COMPLEX, _l3_group),
}
