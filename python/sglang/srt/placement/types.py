"""The frozen values placement passes around: host facts, a rank, its placement."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Callable, Optional

from sglang.srt.placement.cpulist import format_cpulist


class PlacementError(RuntimeError):
    """A placement (or the host facts it needs) cannot be computed or applied."""


class SettingError(ValueError):
    """A setting placement cannot use: names it, the value and the fix."""


class MemPolicy(enum.StrEnum):  # strongest first
    BIND = "bind"
    PREFERRED = "preferred"
    NONE = "none"


@dataclass(frozen=True)
class Refusal:
    policy: MemPolicy
    why: str


def descend(
    wanted: MemPolicy, attempt: Callable[[MemPolicy], Optional[str]]
) -> tuple[MemPolicy, tuple[Refusal, ...]]:
    """The in-process memory-policy ladder: ``wanted``, then each weaker one, until
    ``attempt`` accepts one (returns None, else why not)."""
    order = list(MemPolicy)
    refused: list[Refusal] = []
    for policy in order[order.index(wanted) :]:
        why = attempt(policy)
        if why is None:
            return policy, tuple(refused)
        refused.append(Refusal(policy, why))
    return MemPolicy.NONE, tuple(refused)


class Strategy(enum.StrEnum):
    """How a placement is applied, and by whom."""

    EXEC = "exec"  # the launcher starts the rank under numactl
    IN_PROCESS = "in-process"  # a Ray actor binds itself (configure_scheduler_process)
    V1 = "v1"  # SGLANG_NUMA_BIND_V2=0: the legacy bind in configure_scheduler_process
    CPU_AFFINITY = "cpu-affinity"  # upstream's NUMA-blind SGLANG_SET_CPU_AFFINITY slice
    NONE = "none"

    @property
    def in_child(self) -> bool:  # applied by the rank itself, not by its launcher
        return self in (Strategy.IN_PROCESS, Strategy.V1, Strategy.CPU_AFFINITY)


class Launcher(enum.StrEnum):
    MP = "mp"  # sglang's spawn: a child can start under numactl
    RAY = "ray"  # Ray starts the actor: it binds itself


class DeviceIndex(enum.StrEnum):
    """Which numbering a rank's device number (upstream's ``gpu_id``) is in."""

    LOGICAL_GPU = "logical"  # the rank's CUDA/XPU index under its visibility variable
    PHYSICAL_GPU = "physical"  # NVML's index, which Ray's GPU ids are
    CPU_RANK = "cpu-rank"  # a CPU rank's index into SGLANG_CPU_OMP_THREADS_BIND


@dataclass(frozen=True)
class DeviceRef:
    numbering: DeviceIndex
    index: int

    @property
    def label(self) -> str:
        names = {DeviceIndex.PHYSICAL_GPU: "Ray GPU", DeviceIndex.CPU_RANK: "CPU rank"}
        return f"{names.get(self.numbering, 'GPU')} {self.index}"


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: frozenset[int]  # online CPUs; empty for a memory-only (GPU, CXL) node
    memory_kb: Optional[int]  # None: a kernel without NUMA, all the host's memory

    @property
    def has_memory(self) -> bool:
        return self.memory_kb is None or self.memory_kb > 0


@dataclass(frozen=True)
class Cpu:
    cpu_id: int
    node_id: Optional[int]
    package_id: int
    core_id: int
    thread_siblings: frozenset[int]


@dataclass(frozen=True)
class PciDevice:
    address: str  # canonical lower-case dddd:bb:dd.f
    numa_node: Optional[int]  # None where the kernel does not know (-1)
    vendor: str = ""
    device: str = ""
    pci_class: str = ""


@dataclass(frozen=True)
class HostTopology:  # what a host's sysfs (or a snapshot of it) says, read once
    root: str
    nodes: tuple[NumaNode, ...]
    cpus: tuple[Cpu, ...]
    online_cpus: frozenset[int]
    pci_devices: tuple[PciDevice, ...] = ()

    @functools.cached_property
    def _nodes_by_id(self) -> dict[int, NumaNode]:
        return {node.node_id: node for node in self.nodes}

    @functools.cached_property
    def _siblings(self) -> dict[int, frozenset[int]]:
        return {cpu.cpu_id: cpu.thread_siblings | {cpu.cpu_id} for cpu in self.cpus}

    def node(self, node_id: int) -> Optional[NumaNode]:
        return self._nodes_by_id.get(node_id)

    def cpu(self, cpu_id: int) -> Optional[Cpu]:
        return next((cpu for cpu in self.cpus if cpu.cpu_id == cpu_id), None)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(self._nodes_by_id)

    @property
    def cpu_nodes(self) -> tuple[NumaNode, ...]:
        return tuple(node for node in self.nodes if node.cpus)

    def cpu_nodes_within(self, cpus: frozenset[int]) -> tuple[NumaNode, ...]:
        return tuple(node for node in self.cpu_nodes if node.cpus & cpus)

    def pci_device(self, address: str) -> Optional[PciDevice]:
        return next((d for d in self.pci_devices if d.address == address.lower()), None)

    def cores_within(self, cpus: frozenset[int]) -> list[frozenset[int]]:
        """The physical cores among ``cpus`` (each with its SMT siblings among them),
        in order of their first CPU."""
        cores = {self._siblings.get(cpu, frozenset([cpu])) & cpus for cpu in cpus}
        return sorted(cores, key=min)


@dataclass(frozen=True)
class ProcessAffinity:  # what a cpuset or an outer numactl/taskset allows
    cpus: frozenset[int]
    mems: frozenset[int]
    source: str  # for reasons: "this process", "--allowed-cpus", "snapshot"


@dataclass(frozen=True)
class Accelerator:  # the physical device a logical index names, and its PCI address
    index: int
    physical_id: str  # as the runtime names it: an index or a GPU- UUID
    pci: Optional[str]
    source: str  # how the PCI address was found ("nvml", "sysfs", ...), or why not


@dataclass(frozen=True)
class RankIdentity:  # a spawn knows only its device: the ranks are None there
    device: Optional[DeviceRef] = None
    dp_rank: Optional[int] = None
    pp_rank: Optional[int] = None
    tp_rank: Optional[int] = None

    @property
    def label(self) -> str:
        if self.tp_rank is None:
            return "this process" if self.device is None else self.device.label
        return f"DP{self.dp_rank or 0} PP{self.pp_rank or 0} TP{self.tp_rank}"


@dataclass(frozen=True)
class NodeChoice:  # a GPU's NUMA node, or None and why
    node: Optional[int]
    reasons: tuple[str, ...]
    degraded: bool = False  # the node should have been known: something failed
    pci: Optional[str] = None


@dataclass(frozen=True)
class ProcessPlacement:  # where a rank runs, how and why; the defaults: unbound
    rank: RankIdentity
    pci: Optional[str] = None
    numa_node: Optional[int] = None
    cpus: frozenset[int] = frozenset()
    mem_nodes: frozenset[int] = frozenset()
    mem_policy: MemPolicy = MemPolicy.NONE
    strategy: Strategy = Strategy.NONE
    reasons: tuple[str, ...] = ()
    numactl_args: tuple[str, ...] = ()  # empty unless strategy is exec
    numactl_path: Optional[str] = None  # the numactl probed: the one exec'd
    launcher: Launcher = Launcher.MP
    degraded: bool = False  # less bound than intended: something failed, not a choice

    @property
    def bound(self) -> bool:
        return self.strategy != Strategy.NONE

    @property
    def label(self) -> str:
        return self.rank.label

    @property
    def summary(self) -> str:  # one line: what is bound, how, and why
        why = "; ".join(self.reasons)
        if not self.bound:
            return f"not bound -- {why}"
        mem = {"bind": "membind", "preferred": "preferred"}.get(self.mem_policy)
        mem = f"{mem} {format_cpulist(self.mem_nodes)}" if mem else "memory unbound"
        node = "" if self.numa_node is None else f"node {self.numa_node} "
        cpus = format_cpulist(self.cpus) or "(unchanged)"
        return f"{node}CPUs {cpus} {mem} via {self.strategy} -- {why}"
