"""The frozen values placement passes around: host facts, a rank, its placement."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist


class MemPolicy(enum.StrEnum):
    BIND = "bind"
    PREFERRED = "preferred"
    NONE = "none"


class Strategy(enum.StrEnum):  # numactl before the interpreter, libnuma inside it
    EXEC = "exec"
    IN_PROCESS = "in-process"
    V1 = "v1"
    NONE = "none"


LAUNCHERS = ("mp", "ray")
AFFINITY_MODES = ("node", "exclusive", "socket", "core-complex")


class PlacementError(RuntimeError):
    """A placement (or the host facts it needs) cannot be computed or applied."""


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: frozenset[int]  # online CPUs; empty for a memory-only (GPU, CXL) node
    memory_kb: int
    distances: tuple[tuple[int, int], ...] = ()  # (other node id, distance)

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

    def cpu(self, cpu_id: int) -> Optional[Cpu]:
        return next((c for c in self.cpus if c.cpu_id == cpu_id), None)

    def pci_device(self, address: str) -> Optional[PciDevice]:
        wanted = address.lower()
        return next((d for d in self.pci_devices if d.address == wanted), None)

    def one_cpu_per_core(self, cpus: frozenset[int]) -> frozenset[int]:
        chosen: dict[tuple, int] = {}
        for cpu_id in sorted(cpus):
            cpu = self.cpu(cpu_id)
            key = ("cpu", cpu_id) if cpu is None else (cpu.package_id, cpu.core_id)
            chosen.setdefault(key, cpu_id)
        return frozenset(chosen.values())


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
    source: str  # how the PCI address was found ("torch", "nvml", ...), or why not


@dataclass(frozen=True)
class RankIdentity:
    dp_rank: int
    pp_rank: int
    tp_rank: int
    gpu_id: Optional[int]  # a CPU rank's is its numa_index

    @property
    def label(self) -> str:
        return f"DP{self.dp_rank} PP{self.pp_rank} TP{self.tp_rank}"


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
    launcher: str = "mp"
    warning: bool = False  # less bound than intended because something failed

    def __post_init__(self) -> None:
        # JSON and callers hand in the enums' string values.
        for name, kind in (("mem_policy", MemPolicy), ("strategy", Strategy)):
            object.__setattr__(self, name, kind(getattr(self, name)))

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
        # What a ``failure`` costs (warning or error) is decided where it is applied.
        return cls(
            rank, pci, reasons=tuple(reasons), launcher=launcher, warning=failure
        )

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]}
        data.update(
            cpus=format_cpulist(self.cpus),
            mem_nodes=format_cpulist(self.mem_nodes),
            mem_policy=self.mem_policy.value,
            strategy=self.strategy.value,
            reasons=list(self.reasons),
            numactl_args=list(self.numactl_args),
        )
        return {**dataclasses.asdict(self.rank), **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProcessPlacement":
        # Reads what to_dict wrote.
        given = {f.name: data[f.name] for f in dataclasses.fields(cls)[1:]}
        given.update(
            cpus=parse_cpulist(data["cpus"]),
            mem_nodes=parse_cpulist(data["mem_nodes"]),
            reasons=tuple(data["reasons"]),
            numactl_args=tuple(data["numactl_args"]),
        )
        ranks = (int(data[k]) for k in ("dp_rank", "pp_rank", "tp_rank"))
        return cls(rank=RankIdentity(*ranks, gpu_id=data["gpu_id"]), **given)
