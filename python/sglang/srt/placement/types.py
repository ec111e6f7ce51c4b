"""The frozen values that placement passes around: host facts, a rank's identity, its placement."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist


class MemPolicy(enum.StrEnum):
    """The memory policy a placement sets: bind to its nodes, prefer its node, or leave memory alone."""

    BIND = "bind"
    PREFERRED = "preferred"
    NONE = "none"


class Strategy(enum.StrEnum):
    """How a placement is applied: numactl before the interpreter, libnuma inside it, the legacy V1 bind, or not at all."""

    EXEC = "exec"
    IN_PROCESS = "in-process"
    V1 = "v1"
    NONE = "none"


LAUNCHERS = ("mp", "ray")
AFFINITY_MODES = ("node", "exclusive", "socket", "core-complex")


class TopologyError(ValueError):
    """A sysfs tree (live or a snapshot) is missing files or holds values that cannot be parsed."""


class PlacementError(RuntimeError):
    """A placement cannot be computed or applied, and the policy says to fail rather than run unbound."""


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: frozenset[int]
    """Online CPUs of this node (empty for a memory-only node such as GPU or CXL memory)."""
    memory_kb: int
    """MemTotal of this node; 0 for a node without memory."""
    distances: tuple[tuple[int, int], ...] = ()
    """(other node id, distance) pairs, from ``nodeN/distance``."""

    @property
    def has_cpus(self) -> bool:
        return bool(self.cpus)

    @property
    def has_memory(self) -> bool:
        return self.memory_kb > 0


@dataclass(frozen=True)
class Cpu:
    cpu_id: int
    node_id: Optional[int]
    package_id: int
    core_id: int
    thread_siblings: frozenset[int]
    l3_cpus: Optional[frozenset[int]] = None
    """The online CPUs sharing this CPU's L3 (``cache/index3``); None where sysfs does not say."""


@dataclass(frozen=True)
class PciDevice:
    address: str
    """Canonical lower-case ``dddd:bb:dd.f``."""
    numa_node: Optional[int]
    """None when the kernel does not know (``numa_node`` is -1 or absent)."""
    vendor: str = ""
    device: str = ""
    pci_class: str = ""


@dataclass(frozen=True)
class HostTopology:
    """What a host's sysfs says about NUMA nodes, CPUs and PCI devices, read once."""

    root: str
    nodes: tuple[NumaNode, ...]
    cpus: tuple[Cpu, ...]
    online_cpus: frozenset[int]
    pci_devices: tuple[PciDevice, ...] = ()

    def node(self, node_id: int) -> Optional[NumaNode]:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        return None

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(node.node_id for node in self.nodes)

    @property
    def cpu_nodes(self) -> tuple[NumaNode, ...]:
        return tuple(node for node in self.nodes if node.has_cpus)

    def cpu(self, cpu_id: int) -> Optional[Cpu]:
        for cpu in self.cpus:
            if cpu.cpu_id == cpu_id:
                return cpu
        return None

    def pci_device(self, address: str) -> Optional[PciDevice]:
        wanted = address.lower()
        for dev in self.pci_devices:
            if dev.address == wanted:
                return dev
        return None

    def one_cpu_per_core(self, cpus: frozenset[int]) -> frozenset[int]:
        """The lowest of ``cpus`` on each physical core (SMT siblings left out)."""
        chosen: dict[tuple, int] = {}
        for cpu_id in sorted(cpus):
            cpu = self.cpu(cpu_id)
            key = ("cpu", cpu_id) if cpu is None else (cpu.package_id, cpu.core_id)
            chosen.setdefault(key, cpu_id)
        return frozenset(chosen.values())

    def packages_of_node(self, node_id: int) -> frozenset[int]:
        return frozenset(cpu.package_id for cpu in self.cpus if cpu.node_id == node_id)

    def nodes_of_packages(self, packages: frozenset[int]) -> tuple[int, ...]:
        return tuple(
            sorted(
                {
                    cpu.node_id
                    for cpu in self.cpus
                    if cpu.package_id in packages and cpu.node_id is not None
                }
            )
        )


@dataclass(frozen=True)
class ProcessAffinity:
    """The CPUs and memory nodes a process may use (its cpuset, or an outer numactl/taskset)."""

    cpus: frozenset[int]
    mems: frozenset[int]
    source: str
    """Where the values came from, for reasons: "this process", "--allowed-cpus", "snapshot"."""


@dataclass(frozen=True)
class Accelerator:
    """One logical device as a rank sees it, and the physical device behind it."""

    gpu_id: int
    """The logical device index the rank uses (``cuda:<gpu_id>``)."""
    physical_id: str
    """The physical device as the runtime names it: an index or a ``GPU-`` UUID."""
    pci: Optional[str]
    """Canonical PCI address, or None when it could not be found."""
    source: str
    """How the PCI address was found: "torch", "nvml", "sysfs", "--gpus", or why it was not."""


@dataclass(frozen=True)
class RankIdentity:
    """Which scheduler rank a process is: every placement, log line and report names it."""

    dp_rank: int
    pp_rank: int
    tp_rank: int
    gpu_id: Optional[int]
    """The logical accelerator index, or None for a CPU-device rank."""

    @property
    def label(self) -> str:
        return f"DP{self.dp_rank} PP{self.pp_rank} TP{self.tp_rank}"


@dataclass(frozen=True)
class ProcessPlacement:
    """Where one scheduler rank runs and how that binding is applied, with the reasons."""

    rank: RankIdentity
    pci: Optional[str]
    numa_node: Optional[int]
    cpus: frozenset[int]
    mem_nodes: frozenset[int]
    mem_policy: MemPolicy
    strategy: Strategy
    reasons: tuple[str, ...]
    numactl_args: tuple[str, ...] = ()
    """numactl options (no executable) that apply this placement; empty unless strategy is exec."""
    launcher: str = "mp"
    warning: bool = False
    """True when the rank is unbound (or less bound) because something failed, not by choice."""

    def __post_init__(self) -> None:
        # Accept the enums' string values too (JSON, older callers); store the enums.
        for name, kind in (("mem_policy", MemPolicy), ("strategy", Strategy)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = tuple(member.value for member in kind)
                raise ValueError(f"{name} {value!r} is not one of {allowed}") from None

    @property
    def bound(self) -> bool:
        return self.strategy is not Strategy.NONE

    @property
    def label(self) -> str:
        return self.rank.label

    @classmethod
    def unbound(
        cls,
        rank: RankIdentity,
        *,
        reasons: Sequence[str],
        launcher: str,
        failure: bool,
        pci: Optional[str] = None,
    ) -> "ProcessPlacement":
        """The one way to leave ``rank`` unbound; ``failure`` marks it less bound than
        intended, and what that costs (a warning or an error) is decided where it is
        applied."""
        return cls(
            rank=rank,
            pci=pci,
            numa_node=None,
            cpus=frozenset(),
            mem_nodes=frozenset(),
            mem_policy=MemPolicy.NONE,
            strategy=Strategy.NONE,
            reasons=tuple(reasons),
            launcher=launcher,
            warning=failure,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp_rank": self.rank.dp_rank,
            "pp_rank": self.rank.pp_rank,
            "tp_rank": self.rank.tp_rank,
            "gpu_id": self.rank.gpu_id,
            "pci": self.pci,
            "numa_node": self.numa_node,
            "cpus": format_cpulist(self.cpus),
            "mem_nodes": format_cpulist(self.mem_nodes),
            "mem_policy": self.mem_policy.value,
            "strategy": self.strategy.value,
            "reasons": list(self.reasons),
            "numactl_args": list(self.numactl_args),
            "launcher": self.launcher,
            "warning": self.warning,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProcessPlacement":
        return cls(
            rank=RankIdentity(
                dp_rank=int(data["dp_rank"]),
                pp_rank=int(data["pp_rank"]),
                tp_rank=int(data["tp_rank"]),
                gpu_id=data["gpu_id"],
            ),
            pci=data["pci"],
            numa_node=data["numa_node"],
            cpus=parse_cpulist(data["cpus"]),
            mem_nodes=parse_cpulist(data.get("mem_nodes", "")),
            mem_policy=data["mem_policy"],
            strategy=data["strategy"],
            reasons=tuple(data["reasons"]),
            numactl_args=tuple(data.get("numactl_args", ())),
            launcher=data.get("launcher", "mp"),
            warning=bool(data.get("warning", False)),
        )

    def replace(self, **changes: Any) -> "ProcessPlacement":
        return dataclasses.replace(self, **changes)
