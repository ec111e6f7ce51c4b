"""What the user decides about placement: each environment variable, read here once
(what upstream's ``EnvStr`` fields hand over unchecked is validated), the policy they
make with ServerArgs, the ``--numa-node`` list, and each CPU rank's CPUs under
SGLANG_CPU_OMP_THREADS_BIND."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from sglang.srt.environ import envs
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import (
    HostTopology,
    Launcher,
    ProcessAffinity,
    SettingError,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# Which device an index names: read as the rank's own, which its launcher may change.
DEVICE_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "ZE_AFFINITY_MASK",
    "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
)
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
# Its groups bound rank index ``gpu_id``, which counts across sglang-router's workers.
_OMP = "SGLANG_CPU_OMP_THREADS_BIND"


def bind_v2() -> bool:
    return bool(envs.SGLANG_NUMA_BIND_V2.get())  # False: the legacy in-child bind


def auto_numa_bind() -> bool:
    return bool(envs.SGLANG_AUTO_NUMA_BIND.get())


def bind_failure_is_fatal() -> bool:
    return bool(envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.get())


def set_cpu_affinity() -> bool:  # the rank's own slice of cores
    return bool(envs.SGLANG_SET_CPU_AFFINITY.get())


def cpu_threads_bind() -> str:
    value = str(envs.SGLANG_CPU_OMP_THREADS_BIND.get()).strip()
    if not value:
        raise SettingError(
            "SGLANG_CPU_OMP_THREADS_BIND is empty: set it to 'all' or to one cpulist "
            "per rank, e.g. 0-31|32-63"
        )
    return value


def device_env(names: Sequence[str] = DEVICE_VARS) -> dict[str, str]:
    """Those of ``names`` set here (by default the device-visibility variables)."""
    return {name: os.environ[name] for name in names if name in os.environ}


def listed_node(numa_nodes: Sequence[int], index: int) -> int:
    """``--numa-node``'s entry for device ``index``: the one check of its length."""
    if not 0 <= index < len(numa_nodes):
        raise SettingError(
            f"--numa-node has {len(numa_nodes)} "
            f"entr{'y' if len(numa_nodes) == 1 else 'ies'} "
            f"({' '.join(map(str, numa_nodes))}) but a rank uses GPU {index}: give "
            f"one NUMA node per GPU id, at least {index + 1} entries"
        )
    return numa_nodes[index]


@dataclass(frozen=True)
class PlacementPolicy:
    launcher: Launcher
    device: str
    bind_v2: bool = True
    auto_numa_bind: bool = True
    set_cpu_affinity: bool = False
    numa_nodes: Optional[tuple[int, ...]] = None
    cpu_threads_bind: str = "all"  # read (and checked) only for the CPU device
    tp_per_node: int = 1  # upstream's NUMA-blind slice: the host's cores / this

    def __post_init__(self) -> None:  # callers may name the launcher by its value
        if self.launcher not in tuple(Launcher):
            choices = ", ".join(Launcher)
            raise ValueError(f"launcher {self.launcher!r} is not one of {choices}")
        object.__setattr__(self, "launcher", Launcher(self.launcher))

    @property
    def why_unplaced(self) -> Optional[str]:  # whatever the host: nothing to read
        if self.device not in ("cuda", "xpu", "cpu"):
            return f"device {self.device!r}: sglang places only cuda, xpu and cpu ranks"
        if self.device != "cpu" and self.numa_nodes is None and not self.auto_numa_bind:
            return "no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding"
        return None

    @classmethod
    def from_env(
        cls, server_args: "ServerArgs", *, launcher: Launcher
    ) -> "PlacementPolicy":
        # Upstream's helpers promise to read only these fields: any object will do.
        device = getattr(server_args, "device", None) or "cuda"
        numa_nodes = getattr(server_args, "numa_node", None)
        # set_gpu_proc_affinity's tp_size_per_node, from the same fields.
        tp_size, pp, nnodes = (
            _count(server_args, name) for name in ("tp_size", "pp_size", "nnodes")
        )
        return cls(
            launcher=launcher,
            device=device if isinstance(device, str) else "cuda",
            bind_v2=bind_v2(),
            auto_numa_bind=auto_numa_bind(),
            set_cpu_affinity=set_cpu_affinity(),
            numa_nodes=tuple(numa_nodes) if isinstance(numa_nodes, list) else None,
            cpu_threads_bind=cpu_threads_bind() if device == "cpu" else "all",
            tp_per_node=max(tp_size // max(nnodes // pp, 1), 1),
        )


def _count(server_args: object, name: str) -> int:
    value = getattr(server_args, name, 1)
    return value if isinstance(value, int) and value > 0 else 1


def spawn_places_cpu_rank(spec: str, topology: HostTopology) -> bool:
    """Whether a CPU rank's spawn binds it: its group, or ``all`` on several nodes."""
    return spec.strip() != "all" or len(topology.cpu_nodes) > 1


def rank_cpus(
    spec: str, *, index: int, topology: HostTopology, affinity: ProcessAffinity
) -> frozenset[int]:
    if spec.strip() == "all":
        nodes = topology.cpu_nodes_within(affinity.cpus)
        if 0 <= index < len(nodes):
            return nodes[index].cpus & affinity.cpus
        raise SettingError(
            f"{_OMP}=all gives each rank one NUMA node, but rank index {index} "
            f"has none: this host has {len(nodes)} node(s) with CPUs this process "
            f"may use; use fewer ranks, or {_one_per_rank(topology, index)}"
        )
    groups = spec.strip().split("|")
    if not 0 <= index < len(groups):
        raise SettingError(
            f"{_OMP}={spec!r} has {len(groups)} group(s) but rank index {index} "
            f"needs one more: {_one_per_rank(topology, index)}"
        )
    group, cpus = f"{_OMP}: group {index} {groups[index]!r}", _cpus(groups[index])
    if cpus is None:
        raise SettingError(f"{group} is not a cpulist; expected ranges such as '0-3,8'")
    if not cpus:
        raise SettingError(f"{_OMP}: group {index} is empty; every rank needs a CPU")
    online, allowed = topology.online_cpus, affinity.cpus
    if not cpus <= online:
        raise SettingError(
            f"{group} names CPU(s) {format_cpulist(cpus - online)} that are not "
            f"online on this host (online: {format_cpulist(online)})"
        )
    if not cpus <= allowed:
        raise SettingError(
            f"{group} names CPU(s) {format_cpulist(cpus - allowed)} that this "
            f"process may not use ({affinity.source} allows {format_cpulist(allowed)})"
        )
    return cpus


def shared_cpus(spec: str, *, index: int) -> Optional[str]:
    """A note when group ``index`` shares CPUs with another, as upstream allows."""
    groups = [_cpus(part) or frozenset() for part in spec.strip().split("|")]
    mine = groups[index] if 0 <= index < len(groups) else frozenset()
    for other, cpus in enumerate(groups):
        if other != index and mine & cpus:
            return (
                f"{_OMP}: group {index} shares CPU(s) {format_cpulist(mine & cpus)} "
                f"with group {other}, so those ranks compete for them"
            )
    return None


def _cpus(part: str) -> Optional[frozenset[int]]:
    try:
        return parse_cpulist(part)
    except ValueError:
        return None


def _one_per_rank(topology: HostTopology, index: int) -> str:
    cpus = sorted(topology.online_cpus)
    per = max(len(cpus) // (index + 1), 1)
    chunks = (cpus[i * per : (i + 1) * per] or cpus[-1:] for i in range(index + 1))
    example = "|".join(map(format_cpulist, chunks))
    return (
        "give one '|'-separated cpulist per rank (dp_size x tp_size x pp_size, across "
        f"all data-parallel workers), e.g. {_OMP}='{example}'"
    )
