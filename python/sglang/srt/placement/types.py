"""The frozen values placement passes around: host facts, a rank, its placement."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional


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
    """The one memory-policy ladder: ``wanted``, then each weaker one, until ``attempt``
    accepts one (returns None, else why not); NONE fails only if the CPUs alone do."""
    order = list(MemPolicy)
    refused: list[Refusal] = []
    for policy in order[order.index(wanted) :]:
        why = attempt(policy)
        if why is None:
            return policy, tuple(refused)
        refused.append(Refusal(policy, why))
    return MemPolicy.NONE, tuple(refused)


class Strategy(enum.StrEnum):  # numactl before the interpreter, libnuma inside it
    EXEC = "exec"
    IN_PROCESS = "in-process"
    V1 = "v1"
    NONE = "none"


class Launcher(enum.StrEnum):
    MP = "mp"  # sglang's spawn: a child can start under numactl
    RAY = "ray"  # Ray starts the actor: it binds itself


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
    l3_cpus: Optional[frozenset[int]] = None  # None where sysfs has no cache/index3


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

    def node(self, node_id: int) -> Optional[NumaNode]:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(node.node_id for node in self.nodes)

    @property
    def cpu_nodes(self) -> tuple[NumaNode, ...]:
        return tuple(node for node in self.nodes if node.cpus)

    def cpu_nodes_within(self, cpus: frozenset[int]) -> tuple[NumaNode, ...]:
        return tuple(node for node in self.cpu_nodes if node.cpus & cpus)

    def cpu(self, cpu_id: int) -> Optional[Cpu]:
        return next((c for c in self.cpus if c.cpu_id == cpu_id), None)

    def node_of(self, device: PciDevice) -> Optional[int]:
        """Its node; one the kernel does not know is on the only node with CPUs."""
        only = self.cpu_nodes[0].node_id if len(self.cpu_nodes) == 1 else None
        return only if device.numa_node is None else device.numa_node

    def pci_device(self, address: str) -> Optional[PciDevice]:
        return next((d for d in self.pci_devices if d.address == address.lower()), None)

    def core_of(self, cpu_id: int) -> frozenset[int]:  # the CPU and its SMT siblings
        cpu = self.cpu(cpu_id)
        return (cpu.thread_siblings if cpu else frozenset()) | {cpu_id}


@dataclass(frozen=True)
class ProcessAffinity:  # what a cpuset or an outer numactl/taskset allows
    cpus: frozenset[int]
    mems: frozenset[int]
    source: str  # for reasons: "this process", "--allowed-cpus", "snapshot"


@dataclass(frozen=True)
class Accelerator:  # the device a rank uses (cuda:<gpu_id>), the physical one behind
    gpu_id: int
    physical_id: str  # as the runtime names it: an index or a GPU- UUID
    pci: Optional[str]
    source: str  # how the PCI address was found ("nvml", "sysfs", ...), or why not


@dataclass(frozen=True)
class RankIdentity:  # a spawn knows only its GPU id: the rest is None there
    dp_rank: Optional[int] = None
    pp_rank: Optional[int] = None
    tp_rank: Optional[int] = None
    gpu_id: Optional[int] = None  # a CPU rank's is its numa_index

    @property
    def label(self) -> str:
        if self.tp_rank is None:
            return "this process" if self.gpu_id is None else f"GPU {self.gpu_id}"
        return f"DP{self.dp_rank or 0} PP{self.pp_rank or 0} TP{self.tp_rank}"


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
    launcher: Launcher = Launcher.MP
    degraded: bool = False  # less bound than intended: something failed, not a choice

    @property
    def bound(self) -> bool:
        return self.strategy != Strategy.NONE

    @property
    def label(self) -> str:
        return self.rank.label
