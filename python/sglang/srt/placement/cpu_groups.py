"""SGLANG_CPU_OMP_THREADS_BIND, read alike by bootstrap's thread binding, the spawn and
``plan``. The index is the rank's ``gpu_id``; under sglang-router each worker is an
engine whose ids count across the whole setting, so the groups bound the index."""

from __future__ import annotations

from typing import Optional

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
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
    text = spec.strip()
    if text == "all":
        nodes = topology.cpu_nodes
        if not 0 <= index < len(nodes):
            raise SettingError(
                f"{SETTING}=all gives each rank one NUMA node, but rank index {index} "
                f"has none: this host has {len(nodes)} node(s) with CPUs; use fewer "
                "ranks, or give one '|'-separated cpulist per rank, "
                + _example(topology, index)
            )
        cpus = nodes[index].cpus
        return cpus if affinity is None else cpus & affinity.cpus
    groups = text.split("|")
    if not 0 <= index < len(groups):
        raise SettingError(
            f"{SETTING}={spec!r} has {len(groups)} group(s) but rank index {index} "
            "needs one more: give one '|'-separated cpulist per rank (dp_size x "
            "tp_size x pp_size, across all data-parallel workers), "
            + _example(topology, index)
        )
    part = groups[index]
    try:
        cpus = parse_cpulist(part, what=SETTING)
    except ValueError:
        raise SettingError(
            f"{SETTING}: group {index} {part!r} is not a cpulist; expected ranges "
            "such as '0-3,8'"
        ) from None
    if not cpus:
        raise SettingError(
            f"{SETTING}: group {index} is empty; every rank needs at least one CPU"
        )
    bad = f"{SETTING}: group {index} {part!r} names CPU(s)"
    online = topology.online_cpus
    if not cpus <= online:
        raise SettingError(
            f"{bad} {format_cpulist(cpus - online)} that are not online on this host "
            f"(online: {format_cpulist(online)})"
        )
    if affinity is not None and not cpus <= affinity.cpus:
        raise SettingError(
            f"{bad} {format_cpulist(cpus - affinity.cpus)} that this process may not "
            f"use ({affinity.source} allows {format_cpulist(affinity.cpus)})"
        )
    return cpus


def shared_cpus(spec: str, *, index: int) -> Optional[str]:
    """A note when group ``index`` shares CPUs with another, as upstream allows."""
    groups = spec.strip().split("|")
    if not 0 <= index < len(groups):
        return None
    mine = _cpus(groups[index])
    for other, part in enumerate(groups):
        shared = mine & _cpus(part) if other != index else None
        if shared:
            return (
                f"{SETTING}: group {index} shares CPU(s) {format_cpulist(shared)} "
                f"with group {other}, so those ranks compete for them"
            )
    return None


def _cpus(part: str) -> frozenset[int]:
    try:
        return parse_cpulist(part)
    except ValueError:
        return frozenset()


def _example(topology: HostTopology, index: int) -> str:
    count = index + 1
    cpus = sorted(topology.online_cpus) or [0]
    per = max(len(cpus) // count, 1)
    chunks = (cpus[i * per : (i + 1) * per] or cpus[-1:] for i in range(count))
    return f"e.g. {SETTING}='{'|'.join(map(format_cpulist, chunks))}'"
