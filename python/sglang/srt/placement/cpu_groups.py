"""SGLANG_CPU_OMP_THREADS_BIND, read alike by bootstrap, the spawn and ``plan``. Its
groups bound rank index ``gpu_id``, which counts across sglang-router's workers."""

from __future__ import annotations

from typing import Optional

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.settings import SettingError
from sglang.srt.placement.types import HostTopology, ProcessAffinity

SETTING = "SGLANG_CPU_OMP_THREADS_BIND"


def rank_cpus(
    spec: str, *, index: int, topology: HostTopology, affinity: ProcessAffinity
) -> frozenset[int]:
    if spec.strip() == "all":
        nodes = topology.cpu_nodes
        if 0 <= index < len(nodes):
            return nodes[index].cpus & affinity.cpus
        raise SettingError(
            f"{SETTING}=all gives each rank one NUMA node, but rank index {index} "
            f"has none: this host has {len(nodes)} node(s) with CPUs; use fewer "
            f"ranks, or {_one_per_rank(topology, index)}"
        )
    groups = spec.strip().split("|")
    if not 0 <= index < len(groups):
        raise SettingError(
            f"{SETTING}={spec!r} has {len(groups)} group(s) but rank index {index} "
            f"needs one more: {_one_per_rank(topology, index)}"
        )
    group, cpus = f"{SETTING}: group {index} {groups[index]!r}", _cpus(groups[index])
    if cpus is None:
        raise SettingError(f"{group} is not a cpulist; expected ranges such as '0-3,8'")
    if not cpus:
        raise SettingError(f"{SETTING}: group {index} is empty; every rank needs a CPU")
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
                f"{SETTING}: group {index} shares CPU(s) {format_cpulist(mine & cpus)} "
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
        f"all data-parallel workers), e.g. {SETTING}='{example}'"
    )
