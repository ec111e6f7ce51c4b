"""The pure decision of where one rank runs: its node, CPUs and memory nodes, then how that is applied.

``placement_intent`` computes a rank's intent from host facts and policy
alone; ``strategy.choose_strategy`` then probes numactl and picks how it is
applied. ``placement.plan`` chooses the inputs (which rank, which device) for
every launcher, so a rank gets the same answer whichever path asked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.devices import accelerator_pci_devices
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.strategy import (
    HostCapabilities,
    PlacementIntent,
    choose_strategy,
)
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    NumaNode,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

# ---------------------------------------------------------------------------------------------
# Node choice and CPU sets

SHARING_MODES = ("exclusive", "core-complex")
"""Modes that give each GPU of a node its own share of the node's CPUs."""


@dataclass(frozen=True)
class NodeChoice:
    node: Optional[int]
    reasons: tuple[str, ...]
    failure: bool = False
    """True when an unbound rank is a fault: the placement is marked less bound than intended."""


def choose_node(
    *,
    topology: HostTopology,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
) -> NodeChoice:
    """Upstream's order: the explicit --numa-node list, then SGLANG_AUTO_NUMA_BIND, then the PCI numa_node."""
    if policy.numa_nodes is not None and rank.gpu_id is not None:
        if rank.gpu_id >= len(policy.numa_nodes):
            raise PlacementError(
                f"--numa-node has {len(policy.numa_nodes)} entr{'y' if len(policy.numa_nodes) == 1 else 'ies'} "
                f"({' '.join(map(str, policy.numa_nodes))}) but {rank.label} uses GPU {rank.gpu_id}: give one node "
                f"per GPU id, at least {rank.gpu_id + 1} entries"
            )
        node = policy.numa_nodes[rank.gpu_id]
        if topology.node(node) is None:
            raise PlacementError(
                f"--numa-node gives node {node} for GPU {rank.gpu_id}, but this host has nodes "
                f"{format_cpulist(topology.node_ids)}"
            )
        return NodeChoice(
            node=node, reasons=(f"node {node} from --numa-node (GPU {rank.gpu_id})",)
        )
    if not policy.auto_numa_bind:
        return NodeChoice(
            node=None,
            reasons=("no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding",),
        )
    if accelerator is None:
        return NodeChoice(
            node=None,
            reasons=("no accelerator identified for this rank",),
            failure=True,
        )
    if accelerator.pci is None:
        return NodeChoice(
            node=None,
            reasons=(
                f"GPU {accelerator.gpu_id} ({accelerator.physical_id}): no PCI address ({accelerator.source})",
            ),
            failure=True,
        )
    device = topology.pci_device(accelerator.pci)
    via = f"GPU {accelerator.gpu_id} is {accelerator.physical_id} at PCI {accelerator.pci} ({accelerator.source})"
    if device is None:
        return NodeChoice(
            node=None,
            reasons=(via, f"PCI {accelerator.pci} is not in {topology.root}"),
            failure=True,
        )
    if device.numa_node is None:
        cpu_nodes = topology.cpu_nodes
        if len(cpu_nodes) == 1 and policy.affinity_mode in SHARING_MODES:
            only = cpu_nodes[0].node_id
            return NodeChoice(
                node=only,
                reasons=(
                    via,
                    f"PCI {accelerator.pci} reports numa_node -1; node {only} is the only node with CPUs",
                ),
            )
        return NodeChoice(
            node=None,
            reasons=(
                via,
                f"PCI {accelerator.pci} reports numa_node -1 (the kernel does not know its node)",
            ),
        )
    return NodeChoice(
        node=device.numa_node,
        reasons=(via, f"node {device.numa_node} from PCI {accelerator.pci}"),
    )


def node_accelerators(
    topology: HostTopology, *, node_id: int, device: str
) -> tuple[str, ...]:
    """PCI addresses of the ``device`` accelerators attached to ``node_id``, in PCI order.

    Every rank on the host computes the same list from sysfs alone, so a
    spawned child and a Ray actor on one GPU agree on its index without asking
    each other. A device whose node the kernel does not know counts for the
    only node with CPUs, where ``choose_node`` places it.
    """
    only = topology.cpu_nodes[0].node_id if len(topology.cpu_nodes) == 1 else None
    return tuple(
        dev.address
        for dev in accelerator_pci_devices(topology, device=device)
        if (dev.numa_node if dev.numa_node is not None else only) == node_id
    )


def physical_cores(
    cpus: frozenset[int], *, topology: HostTopology
) -> tuple[frozenset[int], ...]:
    """``cpus`` grouped by physical core, in CPU order, so a slice never splits SMT siblings."""
    cores: list[frozenset[int]] = []
    seen: set[int] = set()
    for cpu_id in sorted(cpus):
        if cpu_id in seen:
            continue
        info = topology.cpu(cpu_id)
        core = ((info.thread_siblings if info else frozenset()) & cpus) | {cpu_id}
        seen.update(core)
        cores.append(frozenset(core))
    return tuple(cores)


@dataclass(frozen=True)
class ModeCpus:
    """The CPUs an affinity mode gives one GPU of a node, and whether it got less than asked."""

    cpus: frozenset[int]
    reasons: tuple[str, ...]
    warning: bool = False


def exclusive_cpus(
    allowed: frozenset[int],
    *,
    topology: HostTopology,
    node_id: int,
    index: int,
    count: int,
) -> ModeCpus:
    """Slice ``index`` of ``count`` of ``allowed``: whole cores, contiguous, sizes as even as possible.

    With fewer cores than GPUs the slices are single CPUs; with fewer CPUs
    than GPUs the GPUs wrap round and share, which is less than asked.
    """
    units = physical_cores(allowed, topology=topology)
    reasons = [
        f"exclusive mode: GPU {index + 1} of {count} on node {node_id} (PCI order) "
        f"gets slice {index + 1} of the node's {len(units)} allowed cores"
    ]
    warning = False
    if len(units) < count:
        units = tuple(frozenset({cpu}) for core in units for cpu in sorted(core))
        reasons.append(
            f"node {node_id} has fewer allowed cores than GPUs: slices split SMT siblings"
        )
    if len(units) < count:
        reasons.append(
            f"node {node_id} has {len(units)} allowed CPUs for {count} GPUs: GPUs share CPUs"
        )
        return ModeCpus(units[index % len(units)], tuple(reasons), warning=True)
    base, extra = divmod(len(units), count)
    start = index * base + min(index, extra)
    size = base + (1 if index < extra else 0)
    return ModeCpus(
        frozenset().union(*units[start : start + size]), tuple(reasons), warning
    )


def core_complex_cpus(
    allowed: frozenset[int],
    *,
    topology: HostTopology,
    node_id: int,
    index: int,
    count: int,
) -> Optional[ModeCpus]:
    """The L3 group GPU ``index`` of ``count`` gets on its node, or None when sysfs has no L3 groups.

    Groups are the allowed CPUs sharing one ``cache/index3``, ordered by their
    lowest CPU; GPUs beyond the number of groups wrap round and share one.
    """
    groups: dict[frozenset[int], None] = {}
    for cpu_id in sorted(allowed):
        info = topology.cpu(cpu_id)
        if info is None or info.l3_cpus is None:
            return None
        groups.setdefault(info.l3_cpus & allowed)
    ordered = sorted(groups, key=min)
    chosen = index % len(ordered)
    reasons = [
        f"core-complex mode: GPU {index + 1} of {count} on node {node_id} (PCI order) "
        f"gets L3 group {chosen + 1} of {len(ordered)}"
    ]
    if count > len(ordered):
        reasons.append(
            f"node {node_id} has {count} GPUs for {len(ordered)} L3 groups: GPUs wrap "
            "round and share a group"
        )
    return ModeCpus(ordered[chosen], tuple(reasons))


def _mode_cpus(
    allowed: frozenset[int],
    *,
    topology: HostTopology,
    node_id: int,
    pci: Optional[str],
    policy: PlacementPolicy,
) -> ModeCpus:
    """The CPUs ``exclusive`` or ``core-complex`` gives the GPU at ``pci``, or the whole
    node's with the reason when the topology lacks what the mode needs."""
    mode = policy.affinity_mode
    gpus = node_accelerators(topology, node_id=node_id, device=policy.device)
    if pci not in gpus:
        return ModeCpus(
            allowed,
            (
                f"{mode} mode: GPU {pci or '(no PCI address)'} is not among node "
                f"{node_id}'s {policy.device} devices in sysfs "
                f"({', '.join(gpus) or 'none'}): bound to the whole node",
            ),
            warning=True,
        )
    ask = dict(
        topology=topology, node_id=node_id, index=gpus.index(pci), count=len(gpus)
    )
    if mode == "exclusive":
        return exclusive_cpus(allowed, **ask)
    found = core_complex_cpus(allowed, **ask)
    if found is not None:
        return found
    return ModeCpus(
        allowed,
        (
            f"core-complex mode: sysfs has no L3 groups (cache/index3) for node "
            f"{node_id}'s CPUs: bound to the whole node",
        ),
        warning=True,
    )


def _node_cpu_set(
    *,
    topology: HostTopology,
    node: NumaNode,
    policy: PlacementPolicy,
    affinity: ProcessAffinity,
    pci: Optional[str],
) -> tuple[frozenset[int], tuple[int, ...], Optional[tuple[int, ...]], list[str], bool]:
    """(cpus, memory nodes, whole nodes for --cpunodebind or None, reasons, warning)."""
    reasons: list[str] = []
    if policy.affinity_mode == "socket":
        packages = topology.packages_of_node(node.node_id)
        node_ids = topology.nodes_of_packages(packages) or (node.node_id,)
        nodes = [topology.node(n) for n in node_ids]
        nodes = [n for n in nodes if n is not None]
        reasons.append(
            f"socket mode: package {format_cpulist(packages)} holds node(s) {format_cpulist(node_ids)}"
        )
    else:
        nodes = [node]
    span = frozenset().union(*(n.cpus for n in nodes))
    allowed = span & affinity.cpus
    if allowed != span and allowed:
        reasons.append(
            f"{affinity.source} allows {len(allowed)} of {len(span)} CPUs of node(s) "
            f"{format_cpulist(n.node_id for n in nodes)}"
        )
    mem_nodes = tuple(
        n.node_id for n in nodes if n.has_memory and n.node_id in affinity.mems
    )
    whole: Optional[tuple[int, ...]] = (
        tuple(n.node_id for n in nodes) if allowed == span else None
    )
    if policy.affinity_mode not in SHARING_MODES or not allowed:
        return allowed, mem_nodes, whole, reasons, False
    mode = _mode_cpus(
        allowed, topology=topology, node_id=node.node_id, pci=pci, policy=policy
    )
    reasons.extend(mode.reasons)
    if mode.cpus != allowed or not mode.warning:
        whole = None  # a mode's share is a CPU list, even a node's only GPU's
    return mode.cpus, mem_nodes, whole, reasons, mode.warning


# ---------------------------------------------------------------------------------------------
# The decision


def placement_intent(
    *,
    topology: HostTopology,
    affinity: ProcessAffinity,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
    cpu_rank_set: Optional[frozenset[int]] = None,
) -> Union[PlacementIntent, ProcessPlacement]:
    """Where ``rank`` should run (an intent), or its unbound placement with the reason.

    Pure, and blind to the other ranks, so that whichever process asks for a
    GPU (a spawned child, a Ray actor, ``plan``) gets the same answer.
    ``cpu_rank_set`` is a CPU-device rank's CPUs from SGLANG_CPU_OMP_THREADS_BIND.
    """
    pci = accelerator.pci if accelerator is not None else None
    unbound = functools.partial(
        ProcessPlacement.unbound, rank, launcher=policy.launcher, pci=pci
    )
    if policy.device == "cpu":
        return _cpu_intent(
            topology=topology,
            affinity=affinity,
            rank=rank,
            policy=policy,
            cpu_rank_set=cpu_rank_set,
        )

    choice = choose_node(
        topology=topology, rank=rank, accelerator=accelerator, policy=policy
    )
    reasons = list(choice.reasons)
    if choice.node is None:
        return unbound(reasons=reasons, failure=choice.failure)
    node = topology.node(choice.node)
    if node is None:
        return unbound(
            reasons=reasons + [f"node {choice.node} does not exist on this host"],
            failure=True,
        )
    if not node.has_cpus:
        return unbound(
            reasons=reasons + [f"node {node.node_id} has memory but no CPUs"],
            failure=True,
        )
    if (
        policy.affinity_mode == "node"
        and policy.numa_nodes is None
        and len(topology.cpu_nodes) == 1
    ):
        return unbound(reasons=reasons + [ONE_NODE_REASON], failure=False)
    cpus, mem_nodes, whole, cpu_reasons, warning = _node_cpu_set(
        topology=topology, node=node, policy=policy, affinity=affinity, pci=pci
    )
    reasons.extend(cpu_reasons)
    if not cpus:
        return unbound(
            reasons=reasons
            + [
                f"NUMA node {node.node_id} has no CPU cores allowed by the current affinity "
                f"{format_cpulist(affinity.cpus)} ({affinity.source}; node CPUs "
                f"{format_cpulist(node.cpus)}), skipping NUMA binding"
            ],
            failure=True,
        )
    return _intent(rank, pci, node.node_id, cpus, mem_nodes, whole, reasons, warning)


ONE_NODE_REASON = (
    "this host has one NUMA node with CPUs: node binding cannot help "
    "(exclusive and core-complex modes still share it out between its GPUs)"
)


def _intent(
    rank: RankIdentity,
    pci: Optional[str],
    node_id: int,
    cpus: frozenset[int],
    mem_nodes: tuple[int, ...],
    whole: Optional[tuple[int, ...]],
    reasons: list[str],
    warning: bool = False,
) -> PlacementIntent:
    if not mem_nodes:
        reasons.append(
            f"no memory node this process may use near node {node_id}: CPU binding only"
        )
    return PlacementIntent(
        rank=rank,
        pci=pci,
        node_id=node_id,
        cpus=cpus,
        mem_nodes=mem_nodes,
        whole_nodes=whole,
        reasons=tuple(reasons),
        warning=warning,
    )


def _cpu_intent(
    *,
    topology: HostTopology,
    affinity: ProcessAffinity,
    rank: RankIdentity,
    policy: PlacementPolicy,
    cpu_rank_set: Optional[frozenset[int]],
) -> Union[PlacementIntent, ProcessPlacement]:
    """A CPU-device rank: the CPUs SGLANG_CPU_OMP_THREADS_BIND gives it, memory on the nodes of those CPUs."""
    unbound = functools.partial(
        ProcessPlacement.unbound, rank, launcher=policy.launcher
    )
    spec = policy.cpu_threads_bind.strip()
    reasons = [
        f"CPU rank {rank.gpu_id}: CPUs {format_cpulist(cpu_rank_set or ())} from SGLANG_CPU_OMP_THREADS_BIND="
        f"{'all (one node per rank)' if spec == 'all' else repr(spec)}"
    ]
    if not policy.bind_v2:
        return unbound(
            reasons=reasons
            + [
                "SGLANG_NUMA_BIND_V2=0: the spawn is not bound (upstream behaviour); only bootstrap's "
                "init_cpu_threads_env pins the OpenMP threads, on AMX or arm64 hosts"
            ],
            failure=False,
        )
    if cpu_rank_set is None:
        raise ValueError(
            f"{rank.label}: a CPU-device rank needs its CPUs from SGLANG_CPU_OMP_THREADS_BIND"
        )
    if spec == "all" and len(topology.cpu_nodes) == 1:
        return unbound(
            reasons=reasons
            + [
                "this host has one NUMA node with CPUs: binding a rank to all of it cannot help"
            ],
            failure=False,
        )
    cpus = cpu_rank_set & affinity.cpus
    counts: dict[int, int] = {}
    for node in topology.nodes:
        shared = len(node.cpus & cpus)
        if shared:
            counts[node.node_id] = shared
    node_id = max(counts, key=lambda n: (counts[n], -n)) if counts else None
    if not cpus or node_id is None:
        return unbound(
            reasons=reasons + ["none of these CPUs may be used by this process"],
            failure=True,
        )
    mem_nodes = tuple(
        n
        for n in sorted(counts)
        if (nn := topology.node(n)) is not None and nn.has_memory and n in affinity.mems
    )
    whole = (
        tuple(sorted(counts))
        if cpus == frozenset().union(*(topology.node(n).cpus for n in counts))
        else None
    )
    return _intent(rank, None, node_id, cpus, mem_nodes, whole, reasons)


def resolve_placement(
    *,
    topology: HostTopology,
    affinity: ProcessAffinity,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
    capabilities: HostCapabilities,
    cpu_rank_set: Optional[frozenset[int]] = None,
) -> ProcessPlacement:
    """Where ``rank`` runs and how that is applied: its intent, then the strategy ``capabilities`` allow."""
    decided = placement_intent(
        topology=topology,
        affinity=affinity,
        rank=rank,
        accelerator=accelerator,
        policy=policy,
        cpu_rank_set=cpu_rank_set,
    )
    if isinstance(decided, ProcessPlacement):
        return decided
    return choose_strategy(decided, policy=policy, capabilities=capabilities)


# ---------------------------------------------------------------------------------------------
# How a placement reads


def describe(p: ProcessPlacement) -> str:
    """The one-line human form of a placement."""
    gpu_id = p.rank.gpu_id
    if gpu_id is None:
        gpu = ""
    else:  # a CPU rank's id is its numa_index; only an accelerator has a PCI address
        gpu = f" GPU {gpu_id}" if p.pci else f" gpu_id {gpu_id}"
    pci = f" ({p.pci})" if p.pci else ""
    if p.strategy == Strategy.NONE:
        head = f"[{p.label}]{gpu}{pci}: not bound"
    else:
        mem = {
            "bind": f"membind {format_cpulist(p.mem_nodes)}",
            "preferred": f"preferred {format_cpulist(p.mem_nodes)}",
            "none": "memory unbound",
        }[p.mem_policy]
        head = f"[{p.label}]{gpu}{pci}: node {p.numa_node} CPUs {format_cpulist(p.cpus)} {mem} via {p.strategy}"
    return f"{head} -- {'; '.join(p.reasons)}"
