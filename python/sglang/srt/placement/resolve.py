"""Where one rank runs: pure, from host facts and policy, blind to the other ranks, so
a spawned child, a Ray actor and ``plan`` agree on a GPU. Then how (exec, in-process,
V1): numactl is asked once per option set, on the rank's own host."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.devices import accelerator_pci_devices
from sglang.srt.placement.numactl import AssumedNumactl, NumactlProber, cpu_option
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    MemPolicy,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

SHARING_MODES = ("exclusive", "core-complex")  # each GPU gets its share of its node


@dataclass(frozen=True)
class HostCapabilities:  # what can apply a binding (a snapshot's numactl: a stand-in)
    numactl: Optional[NumactlProber]
    libnuma: bool

    @classmethod
    def live(cls) -> "HostCapabilities":
        from sglang.srt.placement.libnuma import load_libnuma
        from sglang.srt.placement.numactl import default_prober

        return cls(numactl=default_prober(), libnuma=load_libnuma() is not None)

    @classmethod
    def snapshot(cls, root: str) -> "HostCapabilities":
        return cls(numactl=AssumedNumactl(root=root), libnuma=True)


@dataclass(frozen=True)
class HostFacts:
    topology: HostTopology
    affinity: ProcessAffinity
    capabilities: HostCapabilities

    @classmethod
    def live(cls) -> "HostFacts":
        from sglang.srt.placement.topology import (
            read_process_affinity,
            read_topology_cached,
        )

        return cls(
            topology=read_topology_cached(settings.sysfs_root()),
            affinity=read_process_affinity(),
            capabilities=HostCapabilities.live(),
        )


class Choice(NamedTuple):  # an answer (None: nothing), why, and if less than intended
    value: Any
    reasons: tuple[str, ...]
    warning: bool = False


def choose_node(
    topology: HostTopology,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
) -> Choice:
    """Upstream's order: the ``--numa-node`` list, else the node of the GPU's PCI
    device; ``accelerator`` may be None only with the list."""
    listed, gpu_id = policy.numa_nodes, rank.gpu_id
    if listed is not None:
        if gpu_id >= len(listed):
            raise PlacementError(
                f"--numa-node has {len(listed)} "
                f"entr{'y' if len(listed) == 1 else 'ies'} "
                f"({' '.join(map(str, listed))}) but {rank.label} uses GPU {gpu_id}: "
                f"give one node per GPU id, at least {gpu_id + 1} entries"
            )
        node = listed[gpu_id]
        if topology.node(node) is None:
            raise PlacementError(
                f"--numa-node gives node {node} for GPU {gpu_id}, but this host has "
                f"nodes {format_cpulist(topology.node_ids)}"
            )
        return Choice(node, (f"node {node} from --numa-node (GPU {gpu_id})",))
    pci, gpu, source = accelerator.pci, accelerator.physical_id, accelerator.source
    if pci is None:
        why = f"GPU {gpu_id} ({gpu}): no PCI address ({source})"
        return Choice(None, (why,), True)
    via = f"GPU {gpu_id} is {gpu} at PCI {pci} ({source})"
    device = topology.pci_device(pci)
    if device is None:
        return Choice(None, (via, f"PCI {pci} is not in {topology.root}"), True)
    if device.numa_node is not None:
        return Choice(
            device.numa_node, (via, f"node {device.numa_node} from PCI {pci}")
        )
    why = f"PCI {pci} reports numa_node -1"
    cpu_nodes = topology.cpu_nodes
    if len(cpu_nodes) == 1 and policy.affinity_mode in SHARING_MODES:
        only = cpu_nodes[0].node_id
        return Choice(only, (via, f"{why}; node {only} is the only node with CPUs"))
    return Choice(None, (via, f"{why} (the kernel does not know its node)"))


def _share(
    allowed: frozenset[int],
    node_id: int,
    pci: Optional[str],
    facts: HostFacts,
    policy: PlacementPolicy,
) -> Choice:
    """What the GPU at ``pci`` gets of its node by its index among the node's GPUs in
    PCI order, which every rank computes alone from sysfs (a GPU of unknown node
    counts for the only node with CPUs, as in ``choose_node``). exclusive: a slice of
    whole cores, contiguous, sizes as even as possible; core-complex: one L3 group, by
    lowest CPU. GPUs beyond the cores (groups) split SMT siblings, then wrap round."""
    mode, topology = policy.affinity_mode, facts.topology

    def whole_node(why: str) -> Choice:
        return Choice(allowed, (f"{mode} mode: {why}: bound to the whole node",), True)

    only = topology.cpu_nodes[0].node_id if len(topology.cpu_nodes) == 1 else None
    gpus = [
        dev.address
        for dev in accelerator_pci_devices(topology, device=policy.device)
        if (only if dev.numa_node is None else dev.numa_node) == node_id
    ]
    if pci not in gpus:
        return whole_node(
            f"GPU {pci or '(no PCI address)'} is not among node {node_id}'s "
            f"{policy.device} devices in sysfs ({', '.join(gpus) or 'none'})"
        )
    index, count = gpus.index(pci), len(gpus)
    gets = f"{mode} mode: GPU {index + 1} of {count} on node {node_id} (PCI order) gets"
    cpus = [(cpu_id, topology.cpu(cpu_id)) for cpu_id in sorted(allowed)]
    if mode == "core-complex":
        if any(info is None or info.l3_cpus is None for _, info in cpus):
            return whole_node(
                f"sysfs has no L3 groups (cache/index3) for node {node_id}'s CPUs"
            )
        groups = sorted({info.l3_cpus & allowed for _, info in cpus}, key=min)
        chosen = index % len(groups)
        reasons = [f"{gets} L3 group {chosen + 1} of {len(groups)}"]
        if count > len(groups):
            reasons.append(
                f"node {node_id} has {count} GPUs for {len(groups)} L3 groups: GPUs "
                "wrap round and share a group"
            )
        return Choice(groups[chosen], tuple(reasons))
    units: list[frozenset[int]] = []  # physical cores
    seen: set[int] = set()
    for cpu_id, info in cpus:
        if cpu_id not in seen:
            siblings = info.thread_siblings if info else frozenset()
            units.append((siblings & allowed) | {cpu_id})
            seen |= units[-1]
    reasons = [f"{gets} slice {index + 1} of the node's {len(units)} allowed cores"]
    if len(units) < count:
        units = [frozenset({cpu}) for core in units for cpu in sorted(core)]
        reasons.append(
            f"node {node_id} has fewer allowed cores than GPUs: slices split SMT "
            "siblings"
        )
    if len(units) < count:
        reasons.append(
            f"node {node_id} has {len(units)} allowed CPUs for {count} GPUs: "
            "GPUs share CPUs"
        )
        return Choice(units[index % len(units)], tuple(reasons), True)
    size, extra = divmod(len(units), count)
    start = index * size + min(index, extra)
    share = units[start : start + size + (index < extra)]
    return Choice(frozenset().union(*share), tuple(reasons))


def _gpu_where(
    facts: HostFacts,
    rank: RankIdentity,
    found: Optional[Accelerator],
    policy: PlacementPolicy,
) -> Choice:
    topology, affinity = facts.topology, facts.affinity
    choice = choose_node(topology, rank, found, policy)
    if choice.value is None:
        return choice
    node = topology.node(choice.value)
    if node is None or not node.cpus:
        what = (
            "does not exist on this host" if node is None else "has memory but no CPUs"
        )
        return Choice(None, (*choice.reasons, f"node {choice.value} {what}"), True)
    reasons, nodes = list(choice.reasons), [node]
    if policy.affinity_mode == "socket":
        packages = {c.package_id for c in topology.cpus if c.node_id == node.node_id}
        held = {c.node_id for c in topology.cpus if c.package_id in packages} - {None}
        node_ids = sorted(held) or [node.node_id]
        nodes = [n for n in map(topology.node, node_ids) if n is not None]
        reasons.append(
            f"socket mode: package {format_cpulist(packages)} holds node(s) "
            f"{format_cpulist(node_ids)}"
        )
    span = frozenset().union(*(n.cpus for n in nodes))
    cpus = span & affinity.cpus
    if not cpus:
        why = (
            f"NUMA node {node.node_id} has no CPU cores allowed by the current "
            f"affinity {format_cpulist(affinity.cpus)} ({affinity.source}; node CPUs "
            f"{format_cpulist(node.cpus)}), skipping NUMA binding"
        )
        return Choice(None, (*reasons, why), True)
    if cpus != span:
        reasons.append(
            f"{affinity.source} allows {len(cpus)} of {len(span)} CPUs of node(s) "
            f"{format_cpulist(n.node_id for n in nodes)}"
        )
    whole = tuple(n.node_id for n in nodes) if cpus == span else None
    if policy.affinity_mode not in SHARING_MODES:
        return Choice((node.node_id, cpus, nodes, whole), tuple(reasons))
    share = _share(cpus, node.node_id, found and found.pci, facts, policy)
    if share.value != cpus or not share.warning:
        whole = None  # a mode's share is a CPU list, even a node's only GPU's
    where = (node.node_id, share.value, nodes, whole)
    return Choice(where, (*reasons, *share.reasons), share.warning)


def _cpu_where(
    facts: HostFacts,
    rank: RankIdentity,
    policy: PlacementPolicy,
    rank_cpus: frozenset[int],
) -> Choice:
    """A CPU-device rank: the CPUs SGLANG_CPU_OMP_THREADS_BIND gives it, memory on the
    nodes of those CPUs."""
    topology = facts.topology
    spec = policy.cpu_threads_bind.strip()
    shown = "all (one node per rank)" if spec == "all" else repr(spec)
    reasons = (
        f"CPU rank {rank.gpu_id}: CPUs {format_cpulist(rank_cpus)} from "
        f"SGLANG_CPU_OMP_THREADS_BIND={shown}",
    )
    if not policy.bind_v2:
        why = (
            "SGLANG_NUMA_BIND_V2=0: the spawn is not bound (upstream behaviour); only "
            "bootstrap's init_cpu_threads_env pins the OpenMP threads, on AMX or arm64 "
            "hosts"
        )
        return Choice(None, (*reasons, why))
    if spec == "all" and len(topology.cpu_nodes) == 1:
        why = (
            "this host has one NUMA node with CPUs: binding a rank to all of it "
            "cannot help"
        )
        return Choice(None, (*reasons, why))
    cpus = rank_cpus & facts.affinity.cpus
    counts = {n.node_id: len(n.cpus & cpus) for n in topology.nodes if n.cpus & cpus}
    if not counts:
        why = "none of these CPUs may be used by this process"
        return Choice(None, (*reasons, why), True)
    nodes = [topology.node(n) for n in sorted(counts)]
    exact = frozenset().union(*(n.cpus for n in nodes)) == cpus
    whole = tuple(sorted(counts)) if exact else None
    node_id = max(counts, key=lambda n: (counts[n], -n))
    return Choice((node_id, cpus, nodes, whole), reasons)


def resolve_placement(
    *,
    facts: HostFacts,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
    cpu_rank_set: Optional[frozenset[int]] = None,
) -> ProcessPlacement:
    """Where ``rank`` runs (``cpu_rank_set``: a CPU-device rank's CPUs), and how: exec
    under the strongest numactl form the kernel accepts, else in-process (libnuma),
    or the legacy V1 bind under SGLANG_NUMA_BIND_V2=0."""
    pci = accelerator.pci if accelerator is not None else None
    unbound = functools.partial(
        ProcessPlacement.unbound, rank, launcher=policy.launcher, pci=pci
    )
    if policy.device == "cpu":
        where = _cpu_where(facts, rank, policy, cpu_rank_set)
    else:
        where = _gpu_where(facts, rank, accelerator, policy)
    reasons = list(where.reasons)
    if where.value is None:
        return unbound(reasons=reasons, failure=where.warning)
    node_id, cpus, nodes, whole = where.value
    mems = facts.affinity.mems
    mem_nodes = tuple(n.node_id for n in nodes if n.has_memory and n.node_id in mems)
    if not mem_nodes:
        reasons.append(
            f"no memory node this process may use near node {node_id}: CPU binding only"
        )
    wanted = MemPolicy.BIND if mem_nodes else MemPolicy.NONE

    def placed(
        strategy: Strategy, mem: MemPolicy, args: tuple = (), warning: bool = False
    ) -> ProcessPlacement:
        nodes = (node_id,) if mem == MemPolicy.PREFERRED else mem_nodes
        return ProcessPlacement(
            rank=rank,
            pci=pci,
            numa_node=node_id,
            cpus=cpus,
            mem_nodes=frozenset(nodes if mem != MemPolicy.NONE else ()),
            mem_policy=mem,
            strategy=strategy,
            reasons=tuple(reasons),
            numactl_args=args,
            launcher=policy.launcher,
            warning=warning or where.warning,
        )

    if not policy.bind_v2:
        reasons.append(
            "SGLANG_NUMA_BIND_V2=0: legacy V1 bind inside the child "
            "(numa_run_on_node + numa_set_preferred)"
        )
        preferred = MemPolicy.PREFERRED if mem_nodes else MemPolicy.NONE
        return placed(Strategy.V1, preferred)
    numactl = facts.capabilities.numactl
    if policy.exec_supported and numactl is not None:
        outcome = numactl.ladder(
            cpu_args=(cpu_option(cpus=cpus, whole_nodes=whole),),
            mem_policy=wanted,
            mem_nodes=mem_nodes,
            preferred_node=node_id if mem_nodes else None,
        )
        if outcome.ok:
            got = MemPolicy(outcome.mem_policy)
            reasons.extend(outcome.reasons)
            reasons.append(f"exec under numactl {' '.join(outcome.args)}")
            return placed(Strategy.EXEC, got, outcome.args, got != wanted)
        refusal = f": {outcome.reasons[0]}" if outcome.reasons else ""
        reasons.append(
            f"numactl could not apply NUMA binding for node {node_id} (e.g. "
            "set_mempolicy/sched_setaffinity blocked by seccomp, or cpuset rejects the "
            f"policy){refusal}"
        )
    elif policy.exec_supported:
        reasons.append("numactl is not installed")
    else:
        reasons.append(
            f"the {policy.launcher} launcher cannot start this rank under numactl"
        )
    # A Ray actor binds itself once started; sglang's spawned child runs only sglang's
    # own code, so nothing there would apply an in-process bind.
    if policy.launcher != "ray":
        reasons.append(
            f"the {policy.launcher} launcher binds only by exec: running unbound"
        )
        return unbound(reasons=reasons, failure=True)
    if facts.capabilities.libnuma:
        reasons.append("in-process bind with libnuma")
        return placed(Strategy.IN_PROCESS, wanted)
    reasons.append("libnuma is not available: in-process CPU affinity only")
    return placed(Strategy.IN_PROCESS, MemPolicy.NONE, warning=bool(mem_nodes))


def describe(p: ProcessPlacement) -> str:
    gpu_id, why = p.rank.gpu_id, "; ".join(p.reasons)
    # A CPU rank's id is its numa_index; only an accelerator has a PCI address.
    gpu = "" if gpu_id is None else f" GPU {gpu_id}" if p.pci else f" gpu_id {gpu_id}"
    head = f"[{p.label}]{gpu}{f' ({p.pci})' if p.pci else ''}:"
    if not p.bound:
        return f"{head} not bound -- {why}"
    mem = {"bind": "membind", "preferred": "preferred"}.get(p.mem_policy)
    mem = f"{mem} {format_cpulist(p.mem_nodes)}" if mem else "memory unbound"
    cpus = format_cpulist(p.cpus)
    return f"{head} node {p.numa_node} CPUs {cpus} {mem} via {p.strategy} -- {why}"
