"""Read a process's effective NUMA binding back from the kernel, and compare it with its placement.

Sources: ``/proc/self/status`` (``Cpus_allowed_list``, ``Mems_allowed_list``),
the ``get_mempolicy`` system call (the memory policy of the calling thread), and
``/proc/self/numa_maps`` (where resident pages really are).

Page counts: every mapping's ``N<node>=<pages>`` fields are summed, weighted by
its ``kernelpagesize_kB``, so the totals are kB resident per node over all mapped
memory, file-backed included (shared libraries count where their page-cache
pages sit). The same sum over anonymous mappings only (no ``file=``: heap, stack,
malloc arenas, tensors) is kept alongside, as that is the memory a rank
allocates itself.

Never imports torch: it runs in plain interpreters inside test VMs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.libnuma import read_mempolicy
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import MemPolicy, ProcessPlacement, Strategy

MemPolicyReader = Callable[[], "tuple[str, frozenset[int]]"]


@dataclass(frozen=True)
class ObservedBinding:
    """A process's binding as the kernel reports it."""

    cpus: frozenset[int]
    mems: frozenset[int]
    """Nodes the process may allocate from at all (its cpuset's ``Mems_allowed_list``)."""
    policy: str
    """"default", "bind", "preferred", "interleave", "local", "preferred_many" or
    "weighted_interleave"."""
    policy_nodes: frozenset[int]
    resident_kb: tuple[tuple[int, int], ...] = ()
    """(node, kB resident on it) over every mapping, sorted by node."""
    anon_kb: tuple[tuple[int, int], ...] = ()
    """The same over anonymous mappings only."""

    def local_page_ratio(
        self, nodes: Iterable[int], *, anon_only: bool = False
    ) -> Optional[float]:
        """Share of resident memory on ``nodes`` (0..1); None when numa_maps showed nothing resident."""
        counts = self.anon_kb if anon_only else self.resident_kb
        total = sum(kb for _, kb in counts)
        if total == 0:
            return None
        wanted = frozenset(nodes)
        return sum(kb for node, kb in counts if node in wanted) / total

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpus": format_cpulist(self.cpus),
            "mems": format_cpulist(self.mems),
            "policy": self.policy,
            "policy_nodes": format_cpulist(self.policy_nodes),
            "resident_kb": {str(node): kb for node, kb in self.resident_kb},
            "anon_kb": {str(node): kb for node, kb in self.anon_kb},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ObservedBinding":
        return cls(
            cpus=parse_cpulist(data["cpus"]),
            mems=parse_cpulist(data["mems"]),
            policy=data["policy"],
            policy_nodes=parse_cpulist(data["policy_nodes"]),
            resident_kb=tuple(
                sorted(
                    (int(n), int(kb)) for n, kb in data.get("resident_kb", {}).items()
                )
            ),
            anon_kb=tuple(
                sorted((int(n), int(kb)) for n, kb in data.get("anon_kb", {}).items())
            ),
        )


# -- numa_maps --------------------------------------------------------------------------------

_NODE_FIELD = re.compile(r"^N(\d+)=(\d+)$")


def parse_numa_maps(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """kB resident per node over every mapping, and over anonymous ones only:
    ``N<node>=<pages>`` summed, times each mapping's ``kernelpagesize_kB``."""
    resident: dict[int, int] = {}
    anon: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()[2:]
        page_kb = 4
        for item in fields:
            if item.startswith("kernelpagesize_kB="):
                page_kb = int(item.split("=", 1)[1])
        is_file = any(item.startswith("file=") for item in fields)
        for match in filter(None, map(_NODE_FIELD.match, fields)):
            node, kb = int(match[1]), int(match[2]) * page_kb
            resident[node] = resident.get(node, 0) + kb
            if not is_file:
                anon[node] = anon.get(node, 0) + kb
    return resident, anon


# -- observe ----------------------------------------------------------------------------------


def observe_self(
    *, proc_root: str = "/proc", mempolicy: Optional[MemPolicyReader] = None
) -> ObservedBinding:
    """The binding of this process as the kernel sees it; ``proc_root`` and
    ``mempolicy`` (the get_mempolicy reader) are replaced in tests."""
    base = os.path.join(proc_root, "self")
    allowed = read_process_affinity(os.path.join(base, "status"))
    try:
        with open(os.path.join(base, "numa_maps"), errors="replace") as f:
            resident, anon = parse_numa_maps(f.read())
    except FileNotFoundError:
        # Kernels built without CONFIG_NUMA have no numa_maps: nothing to count.
        resident, anon = {}, {}
    policy, policy_nodes = (mempolicy or read_mempolicy)()
    return ObservedBinding(
        cpus=allowed.cpus,
        mems=allowed.mems,
        policy=policy,
        policy_nodes=policy_nodes,
        resident_kb=tuple(sorted(resident.items())),
        anon_kb=tuple(sorted(anon.items())),
    )


# -- compare ----------------------------------------------------------------------------------


def compare_binding(
    placement: ProcessPlacement, observed: ObservedBinding
) -> list[str]:
    """One line per way ``observed`` differs from ``placement``; empty when the rank is where planned.

    A placement with strategy "none" plans nothing, so nothing is checked. With
    mem_policy "none" only the CPUs are checked. A policy stricter than planned
    (bind where preferred was planned) is reported too: it can fail allocations
    the plan meant to let spill over.
    """
    if placement.strategy == Strategy.NONE:
        return []
    diffs: list[str] = []
    if placement.cpus and observed.cpus != placement.cpus:
        diffs.append(
            f"cpus {_fmt(observed.cpus)} observed, {_fmt(placement.cpus)} planned"
        )

    if placement.mem_policy == MemPolicy.NONE:
        return diffs
    if placement.mem_policy == MemPolicy.BIND:
        want_nodes = placement.mem_nodes
        want_policies = ("bind",)
    else:
        want_nodes = (
            frozenset([placement.numa_node])
            if placement.numa_node is not None
            else placement.mem_nodes
        )
        want_policies = ("preferred", "preferred_many")

    if not want_nodes <= observed.mems:
        diffs.append(
            f"mems allowed {_fmt(observed.mems)} observed, must include {_fmt(want_nodes)} "
            f"(a cpuset or an outer numactl restricts this process)"
        )
    if observed.policy not in want_policies or observed.policy_nodes != want_nodes:
        diffs.append(
            f"memory policy {_policy_text(observed.policy, observed.policy_nodes)} observed, "
            f"{_policy_text(placement.mem_policy, want_nodes)} planned"
        )
    return diffs


def _fmt(values: frozenset[int]) -> str:
    return format_cpulist(values) or "(none)"


def _policy_text(policy: str, nodes: frozenset[int]) -> str:
    if not nodes:
        return policy
    return f"{policy} on node(s) {format_cpulist(nodes)}"
