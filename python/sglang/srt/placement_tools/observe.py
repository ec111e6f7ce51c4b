"""Read a process's NUMA binding back from the kernel, and compare it with its placement.

Sources: ``/proc/self/status`` (allowed CPUs and memory nodes), ``get_mempolicy`` (the
calling thread's memory policy) and ``/proc/self/numa_maps`` (where resident pages are).
Pages are counted in kB per node over every mapping, file-backed included, and over
anonymous mappings only (heap, stack, tensors): the memory a rank allocates itself.
Never imports torch: it runs in plain interpreters inside test VMs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.libnuma import read_mempolicy
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import MemPolicy, ProcessPlacement, Strategy

_NODE_FIELD = re.compile(r"^N(\d+)=(\d+)$")


@dataclass(frozen=True)
class ObservedBinding:
    cpus: frozenset[int]
    mems: frozenset[int]
    """Nodes the process may allocate from at all (its cpuset's ``Mems_allowed_list``)."""
    policy: str
    """As get_mempolicy names it: "default", "bind", "preferred", "interleave", ..."""
    policy_nodes: frozenset[int]
    resident_kb: tuple[tuple[int, int], ...] = ()
    """(node, kB resident on it) over every mapping, sorted by node."""
    anon_kb: tuple[tuple[int, int], ...] = ()

    def local_page_ratio(
        self, nodes: Iterable[int], *, anon_only: bool = False
    ) -> Optional[float]:
        """Share of resident memory on ``nodes``; None when nothing is resident."""
        counts = self.anon_kb if anon_only else self.resident_kb
        total = sum(kb for _, kb in counts)
        wanted = frozenset(nodes)
        return sum(kb for n, kb in counts if n in wanted) / total if total else None

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
        def counts(key: str) -> tuple[tuple[int, int], ...]:
            return tuple(
                sorted((int(n), int(kb)) for n, kb in data.get(key, {}).items())
            )

        return cls(
            cpus=parse_cpulist(data["cpus"]),
            mems=parse_cpulist(data["mems"]),
            policy=data["policy"],
            policy_nodes=parse_cpulist(data["policy_nodes"]),
            resident_kb=counts("resident_kb"),
            anon_kb=counts("anon_kb"),
        )


def parse_numa_maps(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """kB resident per node over every mapping, and over anonymous ones only."""
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


def observe_self(
    *,
    proc_root: str = "/proc",
    mempolicy: Optional[Callable[[], "tuple[str, frozenset[int]]"]] = None,
) -> ObservedBinding:
    """This process's binding as the kernel sees it; tests replace ``proc_root`` and
    ``mempolicy`` (the get_mempolicy reader)."""
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


def compare_binding(
    placement: ProcessPlacement, observed: ObservedBinding
) -> list[str]:
    """One line per way ``observed`` differs from ``placement``; empty when the rank is where planned.

    Strategy "none" plans nothing and mem_policy "none" no memory, so neither is checked. A
    policy stricter than planned (bind where preferred was planned) is a difference too: it
    can fail allocations the plan meant to let spill over.
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
    want_nodes, want_policies = placement.mem_nodes, ("bind",)
    if placement.mem_policy != MemPolicy.BIND:
        want_policies = ("preferred", "preferred_many")
        if placement.numa_node is not None:
            want_nodes = frozenset([placement.numa_node])
    if not want_nodes <= observed.mems:
        diffs.append(
            f"mems allowed {_fmt(observed.mems)} observed, must include {_fmt(want_nodes)} (a cpuset or an outer numactl restricts this process)"
        )
    if observed.policy not in want_policies or observed.policy_nodes != want_nodes:
        diffs.append(
            f"memory policy {_policy_text(observed.policy, observed.policy_nodes)} observed, {_policy_text(placement.mem_policy, want_nodes)} planned"
        )
    return diffs


def _fmt(values: frozenset[int]) -> str:
    return format_cpulist(values) or "(none)"


def _policy_text(policy: str, nodes: frozenset[int]) -> str:
    return f"{policy} on node(s) {format_cpulist(nodes)}" if nodes else policy
