"""Where one rank runs, and how. ``place_gpu_id`` places the GPU id sglang spawns a
scheduler with, under the visibility variables in force. Where is pure (host facts and
policy, blind to other ranks), so a spawned child, a Ray actor and ``plan`` agree on a
GPU; how (exec, in-process, V1) asks numactl on the rank's host, once per option set."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Mapping, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.devices import (
    AcceleratorRuntime,
    identify_accelerators,
    open_runtime,
)
from sglang.srt.placement.libnuma import load_libnuma
from sglang.srt.placement.modes import AffinityMode, GpuNode
from sglang.srt.placement.numactl import NumactlProber, cpu_option, default_prober
from sglang.srt.placement.settings import PlacementPolicy, rank_cpus, shared_cpus
from sglang.srt.placement.topology import read_process_affinity, read_topology_cached
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    Launcher,
    MemPolicy,
    NumaNode,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    SettingError,
    Strategy,
)

RuntimeOpener = Callable[
    [str, HostTopology], ContextManager[Optional[AcceleratorRuntime]]
]


@dataclass(frozen=True)
class HostCapabilities:  # what can apply a binding here
    numactl: Optional[NumactlProber]
    libnuma: bool

    @classmethod
    def live(cls) -> "HostCapabilities":
        return cls(numactl=default_prober(), libnuma=load_libnuma() is not None)


@dataclass(frozen=True)
class HostFacts:
    topology: HostTopology
    affinity: ProcessAffinity
    capabilities: HostCapabilities

    @classmethod
    def live(cls) -> "HostFacts":
        return cls(
            topology=read_topology_cached(settings.sysfs_root()),
            affinity=read_process_affinity(),
            capabilities=HostCapabilities.live(),
        )


@dataclass(frozen=True)
class Where:  # a rank's node, CPUs and memory nodes, before how they are applied
    node_id: Optional[int]  # None: the rank stays unbound, for the reasons
    reasons: tuple[str, ...]
    cpus: frozenset[int] = frozenset()
    nodes: tuple[NumaNode, ...] = ()
    whole: bool = False  # every CPU of ``nodes``
    degraded: bool = False


def choose_node(
    topology: HostTopology,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
) -> Where:
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
        return Where(node, (f"node {node} from --numa-node (GPU {gpu_id})",))
    pci, gpu, source = accelerator.pci, accelerator.physical_id, accelerator.source
    if pci is None:
        why = f"GPU {gpu_id} ({gpu}): no PCI address ({source})"
        return Where(None, (why,), degraded=True)
    via = f"GPU {gpu_id} is {gpu} at PCI {pci} ({source})"
    device = topology.pci_device(pci)
    if device is None:
        return Where(None, (via, f"PCI {pci} is not in {topology.root}"), degraded=True)
    if device.numa_node is not None:
        return Where(device.numa_node, (via, f"node {device.numa_node} from PCI {pci}"))
    why = f"PCI {pci} reports numa_node -1"
    only = topology.node_of(device)
    if only is not None and policy.affinity_mode.shares_node:
        return Where(only, (via, f"{why}; node {only} is the only node with CPUs"))
    return Where(None, (via, f"{why} (the kernel does not know its node)"))


def _gpu_where(
    facts: HostFacts,
    rank: RankIdentity,
    found: Optional[Accelerator],
    policy: PlacementPolicy,
) -> Where:
    topology, affinity = facts.topology, facts.affinity
    choice = choose_node(topology, rank, found, policy)
    if choice.node_id is None:
        return choice
    node = topology.node(choice.node_id)
    if node is None or not node.cpus:
        what = "has memory but no CPUs" if node else "does not exist on this host"
        why = f"node {choice.node_id} {what}"
        return Where(None, (*choice.reasons, why), degraded=True)
    pci = found.pci if found is not None else None
    gpu = GpuNode(topology, node, affinity, pci, policy.device)
    share = policy.affinity_mode.share(gpu)
    reasons = (*choice.reasons, *share.reasons)
    if not share.cpus:
        why = (
            f"NUMA node {node.node_id} has no CPU cores allowed by the current "
            f"affinity {format_cpulist(affinity.cpus)} ({affinity.source}; node CPUs "
            f"{format_cpulist(node.cpus)}), skipping NUMA binding"
        )
        return Where(None, (*reasons, why), degraded=True)
    degraded = share.degraded or choice.degraded
    return Where(node.node_id, reasons, share.cpus, share.nodes, share.whole, degraded)


def _cpu_where(facts: HostFacts, rank: RankIdentity, policy: PlacementPolicy) -> Where:
    """A CPU-device rank: the CPUs SGLANG_CPU_OMP_THREADS_BIND gives its index
    (``gpu_id``), memory on the nodes of those CPUs."""
    topology, affinity = facts.topology, facts.affinity
    spec = policy.cpu_threads_bind.strip()
    cpus = rank_cpus(spec, index=rank.gpu_id, topology=topology, affinity=affinity)
    shown = "all (one node per rank)" if spec == "all" else repr(spec)
    reasons = (
        f"CPU rank {rank.gpu_id}: CPUs {format_cpulist(cpus)} from "
        f"SGLANG_CPU_OMP_THREADS_BIND={shown}",
    )
    if not policy.bind_v2:
        why = (
            "SGLANG_NUMA_BIND_V2=0: the spawn is not bound (upstream behaviour); only "
            "bootstrap's init_cpu_threads_env pins OpenMP threads on AMX or arm64 hosts"
        )
        return Where(None, (*reasons, why))
    if spec == "all" and len(topology.cpu_nodes) == 1:
        why = (
            "this host has one NUMA node with CPUs: binding a rank to all of it "
            "cannot help"
        )
        return Where(None, (*reasons, why))
    counts = {n.node_id: len(n.cpus & cpus) for n in topology.nodes if n.cpus & cpus}
    if not counts:
        why = "none of these CPUs may be used by this process"
        return Where(None, (*reasons, why), degraded=True)
    nodes = tuple(topology.node(n) for n in sorted(counts))
    whole = frozenset().union(*(n.cpus for n in nodes)) == cpus
    node_id = max(counts, key=lambda n: (counts[n], -n))
    return Where(node_id, reasons, cpus, nodes, whole)


def resolve_placement(
    *,
    facts: HostFacts,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
) -> ProcessPlacement:
    """Where ``rank`` runs, and how: exec under the strongest numactl form the kernel
    accepts, else in-process (libnuma), or V1's bind under SGLANG_NUMA_BIND_V2=0."""
    pci = accelerator.pci if accelerator is not None else None
    if policy.device == "cpu":
        where = _cpu_where(facts, rank, policy)
    else:
        where = _gpu_where(facts, rank, accelerator, policy)
    placed = ProcessPlacement(
        rank, pci, reasons=where.reasons, launcher=policy.launcher
    )
    if where.node_id is None:
        return replace(placed, degraded=where.degraded)
    mems = facts.affinity.mems
    mem_nodes = [n.node_id for n in where.nodes if n.has_memory and n.node_id in mems]
    if not mem_nodes:
        why = f"no memory node this process may use near node {where.node_id}"
        placed = replace(placed, reasons=(*where.reasons, f"{why}: CPU binding only"))
    placed = replace(
        placed,
        numa_node=where.node_id,
        cpus=where.cpus,
        mem_nodes=frozenset(mem_nodes),
        mem_policy=MemPolicy.BIND if mem_nodes else MemPolicy.NONE,
        degraded=where.degraded,
    )
    return _how(placed, where, facts=facts, policy=policy)


def _how(
    placed: ProcessPlacement, where: Where, *, facts: HostFacts, policy: PlacementPolicy
) -> ProcessPlacement:
    """How ``placed`` (BIND on its memory nodes, NONE without any) is applied."""
    if not policy.bind_v2:
        why = (
            "SGLANG_NUMA_BIND_V2=0: legacy V1 bind inside the child "
            "(numa_run_on_node + numa_set_preferred)"
        )
        mem = MemPolicy.PREFERRED if placed.mem_nodes else MemPolicy.NONE
        return _applied(placed, Strategy.V1, mem, why)
    if policy.launcher is Launcher.RAY:  # Ray starts the actor: it binds itself
        why = f"the {policy.launcher} launcher cannot start this rank under numactl"
        if facts.capabilities.libnuma:
            how = "in-process bind with libnuma"
            return _applied(placed, Strategy.IN_PROCESS, placed.mem_policy, why, how)
        how = "libnuma is not available: in-process CPU affinity only"
        return _applied(placed, Strategy.IN_PROCESS, MemPolicy.NONE, why, how)
    return _exec(placed, where, facts.capabilities.numactl)


def _exec(
    placed: ProcessPlacement, where: Where, numactl: Optional[NumactlProber]
) -> ProcessPlacement:
    """Under the strongest numactl form the kernel accepts, else unbound: sglang's
    spawned child runs only sglang's code, so nothing there would bind in-process."""
    why = "numactl is not installed"
    if numactl is not None:
        whole = tuple(n.node_id for n in where.nodes) if where.whole else None
        outcome = numactl.ladder(
            cpu_args=(cpu_option(cpus=placed.cpus, whole_nodes=whole),),
            mem_policy=placed.mem_policy,
            mem_nodes=placed.mem_nodes,
            preferred_node=placed.numa_node if placed.mem_nodes else None,
        )
        if outcome.ok:
            got, args = outcome.mem_policy, outcome.args
            how = (*outcome.reasons, f"exec under numactl {' '.join(args)}")
            return _applied(placed, Strategy.EXEC, got, *how, args=args)
        why = (
            f"numactl could not apply NUMA binding for node {placed.numa_node} (e.g. "
            "set_mempolicy/sched_setaffinity blocked by seccomp, or cpuset rejects "
            f"the policy): {outcome.reasons[0]}"
        )
    only = f"the {placed.launcher} launcher binds only by exec: running unbound"
    unbound = ProcessPlacement(placed.rank, placed.pci, launcher=placed.launcher)
    return replace(unbound, reasons=(*placed.reasons, why, only), degraded=True)


def _applied(
    placed: ProcessPlacement,
    strategy: Strategy,
    mem: MemPolicy,
    *why: str,
    args: tuple[str, ...] = (),
) -> ProcessPlacement:
    """``placed`` applied by ``strategy`` with memory policy ``mem``: less than wanted
    is degraded, except under V1, upstream's own preferred policy."""
    nodes = {MemPolicy.BIND: placed.mem_nodes, MemPolicy.PREFERRED: {placed.numa_node}}
    return replace(
        placed,
        strategy=strategy,
        mem_policy=mem,
        mem_nodes=frozenset(nodes.get(mem, ())),
        reasons=(*placed.reasons, *why),
        numactl_args=args,
        degraded=placed.degraded
        or (mem != placed.mem_policy and strategy != Strategy.V1),
    )


def _identify(
    gpu_id: int,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: RuntimeOpener = open_runtime,
) -> Accelerator:
    with runtime(device, topology) as opened:
        return identify_accelerators(
            device=device, topology=topology, env=env, gpu_ids=[gpu_id], runtime=opened
        )[0]


def device_node(
    gpu_id: int, *, device: str, topology: HostTopology, env: Mapping[str, str]
) -> Where:
    """Upstream's question: the node of ``gpu_id``'s device (None: no node, and why)."""
    try:
        found = _identify(gpu_id, device, topology, env)
    except SettingError as exc:
        return Where(None, (str(exc),))
    policy = PlacementPolicy(launcher=Launcher.MP, device=device)
    return choose_node(topology, RankIdentity(gpu_id=gpu_id), found, policy)


def place_gpu_id(
    gpu_id: int,
    *,
    policy: PlacementPolicy,
    env: Mapping[str, str],
    facts: Optional[HostFacts] = None,
    rank: Optional[RankIdentity] = None,
    runtime: RuntimeOpener = open_runtime,
) -> ProcessPlacement:
    """Where the scheduler spawned with ``gpu_id`` (a CPU rank's numa_index) runs,
    under the ``env`` it inherits; ``runtime`` opens what names physical devices.
    ``facts`` (default: this host's) are read only where the policy may place."""
    rank = replace(rank or RankIdentity(), gpu_id=gpu_id)
    if why := policy.why_unplaced:  # as upstream, nothing is read
        return ProcessPlacement(rank, reasons=(why,), launcher=policy.launcher)
    facts = facts or HostFacts.live()
    if policy.device == "cpu":
        placed = resolve_placement(
            facts=facts, rank=rank, accelerator=None, policy=policy
        )
        note = shared_cpus(policy.cpu_threads_bind, index=gpu_id)
        return placed if not note else noted(placed, note)
    one_node = len(facts.topology.cpu_nodes) < 2 and policy.numa_nodes is None
    if one_node and policy.affinity_mode.idle_on_one_node:
        shared = " and ".join(mode for mode in AffinityMode if mode.shares_node)
        why = (
            "this host has one NUMA node with CPUs: node binding cannot help "
            f"({shared} modes still share it out between its GPUs)"
        )
        return ProcessPlacement(rank, reasons=(why,), launcher=policy.launcher)
    try:
        found = _identify(gpu_id, policy.device, facts.topology, env, runtime)
    except SettingError as exc:
        if policy.numa_nodes is None:
            why = f"GPU {gpu_id} cannot be identified: {exc}"
            return ProcessPlacement(
                rank, reasons=(why,), launcher=policy.launcher, degraded=True
            )
        found = None  # the --numa-node list needs no device
    return resolve_placement(facts=facts, rank=rank, accelerator=found, policy=policy)


def noted(placement: ProcessPlacement, note: str) -> ProcessPlacement:
    return replace(placement, reasons=(note, *placement.reasons))
