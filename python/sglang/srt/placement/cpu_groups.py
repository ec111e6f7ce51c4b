"""SGLANG_CPU_OMP_THREADS_BIND: which CPUs a CPU-device rank gets, one reading for every reader.

Bootstrap's ``init_threads_binding(numa_index=gpu_id, world_size=...)`` pins a
CPU rank's OpenMP threads from this setting, ``configure_subprocess`` starts
the rank under the same CPUs, and ``plan`` shows them: all three read it here.
The rank's index is the ``gpu_id`` sglang hands it (with sglang-router's data
parallelism, each worker is an engine of its own whose id counts across the
whole setting), so the number of groups bounds the index, not the engine size.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.settings import SettingError
from sglang.srt.placement.types import HostTopology, ProcessAffinity

SETTING = "SGLANG_CPU_OMP_THREADS_BIND"


def rank_cpus(
    spec: str,
    *,
    index: int,
    topology: HostTopology,
    affinity: Optional[ProcessAffinity] = None,
) -> frozenset[int]:
    """The CPUs of CPU rank ``index``: with ``all`` its node's (allowed) CPUs, else its ``|`` group."""
    text = spec.strip()
    if text == "all":
        cpu_nodes = topology.cpu_nodes
        if not 0 <= index < len(cpu_nodes):
            raise SettingError(
                f"{SETTING}=all gives each rank one NUMA node, but rank index {index} has none: "
                f"this host has {len(cpu_nodes)} node(s) with CPUs; use fewer ranks, or give one "
                f"'|'-separated cpulist per rank, e.g. {SETTING}='{example(topology, index + 1)}'"
            )
        cpus = cpu_nodes[index].cpus
        return cpus if affinity is None else cpus & affinity.cpus
    groups = text.split("|")
    if not 0 <= index < len(groups):
        raise SettingError(
            f"{SETTING}={spec!r} has {len(groups)} group(s) but rank index {index} needs one more: "
            f"give one '|'-separated cpulist per rank (dp_size x tp_size x pp_size, across all "
            f"data-parallel workers), e.g. {SETTING}='{example(topology, index + 1)}'"
        )
    return _group(groups[index], index=index, topology=topology, affinity=affinity)


def _group(
    part: str,
    *,
    index: int,
    topology: HostTopology,
    affinity: Optional[ProcessAffinity],
) -> frozenset[int]:
    try:
        cpus = parse_cpulist(part, what=SETTING)
    except CpuListError:
        raise SettingError(
            f"{SETTING}: group {index} {part!r} is not a cpulist; expected ranges such as '0-3,8'"
        ) from None
    if not cpus:
        raise SettingError(
            f"{SETTING}: group {index} is empty; every rank needs at least one CPU"
        )
    offline = cpus - topology.online_cpus
    if offline:
        raise SettingError(
            f"{SETTING}: group {index} {part!r} names CPU(s) {format_cpulist(offline)} that are "
            f"not online on this host (online: {format_cpulist(topology.online_cpus)})"
        )
    if affinity is not None and not cpus <= affinity.cpus:
        raise SettingError(
            f"{SETTING}: group {index} {part!r} names CPU(s) "
            f"{format_cpulist(cpus - affinity.cpus)} that this process may not use "
            f"({affinity.source} allows {format_cpulist(affinity.cpus)})"
        )
    return cpus


def shared_cpus(spec: str, *, index: int) -> Optional[str]:
    """A note when rank ``index``'s group shares CPUs with another group, else None.

    Overlapping groups are allowed, as upstream allows them (ranks then share
    cores); every reader says so, none refuses them.
    """
    text = spec.strip()
    if text == "all":
        return None
    groups = text.split("|")
    if not 0 <= index < len(groups):
        return None
    try:
        mine = parse_cpulist(groups[index], what=SETTING)
    except CpuListError:
        return None
    for other, part in enumerate(groups):
        if other == index:
            continue
        try:
            shared = mine & parse_cpulist(part, what=SETTING)
        except CpuListError:
            continue
        if shared:
            return (
                f"{SETTING}: group {index} shares CPU(s) {format_cpulist(shared)} with group "
                f"{other}, so those ranks compete for them"
            )
    return None


def example(topology: HostTopology, count: int) -> str:
    """``count`` disjoint groups over this host's online CPUs, for error messages."""
    cpus = sorted(topology.online_cpus)
    if not cpus:
        return "|".join(["0"] * count)
    per = max(len(cpus) // max(count, 1), 1)
    parts = []
    for i in range(count):
        chunk = cpus[i * per : (i + 1) * per] or cpus[-1:]
        parts.append(format_cpulist(chunk))
    return "|".join(parts)
