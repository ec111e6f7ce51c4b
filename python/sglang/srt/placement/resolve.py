"""The pure decision of where ranks run: plan_engine() for a host's ranks, plan_node() for a Ray node's given ranks.

Each rank's intent (node, CPUs, memory nodes) is computed from host facts and
policy alone; ``strategy.choose_strategy`` then probes numactl and picks how it
is applied. Both entry points share one core, so a rank gets the same answer
whichever launcher asked.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.strategy import HostCapabilities, PlacementIntent, choose_strategy
from sglang.srt.placement.types import (
    AFFINITY_MODES,
    Accelerator,
    HostTopology,
    LAUNCHERS,
    MemPolicy,
    NumaNode,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementPolicy:
    """Everything the user decides: env vars and ServerArgs, read once."""

    launcher: str
    device: str
    bind_v2: bool = True
    auto_numa_bind: bool = True
    crash_on_failure: bool = False
    affinity_mode: str = "node"
    numa_nodes: Optional[tuple[int, ...]] = None
    cpu_threads_bind: str = "all"
    exec_supported: bool = True
    """False where the launcher cannot start the process under numactl."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}")
        if self.affinity_mode not in AFFINITY_MODES:
            raise ValueError(
                f"SGLANG_NUMA_AFFINITY_MODE / --numa-affinity-mode={self.affinity_mode!r} is not valid: "
                f"choose one of {', '.join(AFFINITY_MODES)}"
            )

    @classmethod
    def from_env(cls, server_args, *, launcher: str, affinity_mode: Optional[str] = None,
                 exec_supported: bool = True) -> "PlacementPolicy":
        return cls(
            launcher=launcher,
            device=server_args.device,
            bind_v2=settings.bind_v2(),
            auto_numa_bind=settings.auto_numa_bind(),
            crash_on_failure=settings.bind_failure_is_fatal(),
            affinity_mode=affinity_mode or settings.affinity_mode(),
            numa_nodes=tuple(server_args.numa_node) if server_args.numa_node is not None else None,
            cpu_threads_bind=settings.cpu_threads_bind(),
            exec_supported=exec_supported,
        )


# ---------------------------------------------------------------------------------------------
# Which ranks run on this host


def local_ranks(server_args) -> tuple[RankIdentity, ...]:
    """The ranks this node_rank launches, in launch order (dp, pp, tp), with upstream's GPU ids."""
    tp, pp, dp = server_args.tp_size, server_args.pp_size, server_args.dp_size
    nnodes_per_tp_group = max(server_args.nnodes // pp, 1)
    tp_per_node = max(tp // nnodes_per_tp_group, 1)
    pp_per_node = max(pp // server_args.nnodes, 1)
    tp_start = tp_per_node * (server_args.node_rank % nnodes_per_tp_group)
    pp_start = pp_per_node * (server_args.node_rank // nnodes_per_tp_group)
    ranks = []
    for dp_rank in range(dp):
        dp_base = server_args.base_gpu_id + dp_rank * tp_per_node * pp_per_node * server_args.gpu_id_step
        for pp_rank in range(pp_start, pp_start + pp_per_node):
            for tp_rank in range(tp_start, tp_start + tp_per_node):
                gpu_id = dp_base + (
                    (pp_rank % pp_per_node) * tp_per_node + (tp_rank % tp_per_node)
                ) * server_args.gpu_id_step
                ranks.append(
                    RankIdentity(
                        dp_rank=dp_rank,
                        pp_rank=pp_rank,
                        tp_rank=tp_rank,
                        gpu_id=None if server_args.device == "cpu" else gpu_id,
                        global_rank=dp_rank * tp * pp + pp_rank * tp + tp_rank,
                    )
                )
    return tuple(ranks)


def world_size(server_args) -> int:
    return server_args.tp_size * server_args.pp_size * server_args.dp_size


# ---------------------------------------------------------------------------------------------
# CPU-device ranks: SGLANG_CPU_OMP_THREADS_BIND


def cpu_rank_cpus(spec: str, *, index: int, world_size: int, topology: HostTopology,
                  affinity: Optional[ProcessAffinity] = None) -> frozenset[int]:
    """The CPUs of CPU-device rank ``index`` of ``world_size``, from SGLANG_CPU_OMP_THREADS_BIND."""
    name = "SGLANG_CPU_OMP_THREADS_BIND"
    text = spec.strip()
    if text == "all":
        cpu_nodes = topology.cpu_nodes
        if world_size > len(cpu_nodes):
            example = "|".join(_example_groups(topology, world_size))
            raise ValueError(
                f"{name}=all gives each rank one NUMA node, but this host has {len(cpu_nodes)} node(s) with CPUs "
                f"for {world_size} ranks; set {name} to {world_size} '|'-separated cpulists, e.g. {name}='{example}'"
            )
        cpus = cpu_nodes[index].cpus
        if affinity is not None:
            cpus = cpus & affinity.cpus
        return cpus
    groups = text.split("|")
    if len(groups) != world_size:
        example = "|".join(_example_groups(topology, world_size))
        raise ValueError(
            f"{name}={spec!r} has {len(groups)} group(s) but the engine has {world_size} ranks: give one "
            f"'|'-separated cpulist per rank, e.g. {name}='{example}'"
        )
    part = groups[index]
    try:
        cpus = parse_cpulist(part, what=name)
    except CpuListError:
        example = "|".join(_example_groups(topology, world_size))
        raise ValueError(
            f"{name}: group {index} {part!r} is not a cpulist; expected ranges such as '0-3,8', "
            f"e.g. {name}='{example}'"
        ) from None
    if not cpus:
        raise ValueError(f"{name}: group {index} is empty; every rank needs at least one CPU")
    offline = cpus - topology.online_cpus
    if offline:
        raise ValueError(
            f"{name}: group {index} {part!r} names CPU(s) {format_cpulist(offline)} that are not online on this "
            f"host (online: {format_cpulist(topology.online_cpus)})"
        )
    if affinity is not None and not cpus <= affinity.cpus:
        raise ValueError(
            f"{name}: group {index} {part!r} names CPU(s) {format_cpulist(cpus - affinity.cpus)} that this process "
            f"may not use ({affinity.source} allows {format_cpulist(affinity.cpus)})"
        )
    return cpus


def _example_groups(topology: HostTopology, count: int) -> list[str]:
    cpus = sorted(topology.online_cpus)
    if not cpus:
        return ["0"] * count
    per = max(len(cpus) // max(count, 1), 1)
    out = []
    for i in range(count):
        chunk = cpus[i * per:(i + 1) * per] or cpus[-1:]
        out.append(format_cpulist(chunk))
    return out


def validate_cpu_threads_bind(spec: str, *, world_size: int, topology: HostTopology,
                              affinity: Optional[ProcessAffinity] = None) -> tuple[frozenset[int], ...]:
    """Every rank's CPUs; also rejects groups that overlap, which would make ranks share cores."""
    groups = tuple(
        cpu_rank_cpus(spec, index=i, world_size=world_size, topology=topology, affinity=affinity)
        for i in range(world_size)
    )
    for i in range(world_size):
        for j in range(i + 1, world_size):
            shared = groups[i] & groups[j]
            if shared:
                raise ValueError(
                    f"SGLANG_CPU_OMP_THREADS_BIND: groups {i} and {j} share CPU(s) {format_cpulist(shared)}; "
                    f"give each rank its own CPUs"
                )
    return groups


# ---------------------------------------------------------------------------------------------
# Node choice and CPU sets


@dataclass(frozen=True)
class NodeChoice:
    node: Optional[int]
    reasons: tuple[str, ...]
    failure: bool = False
    """True when an unbound rank is a fault (warn, or raise under SGLANG_CRASH_ON_NUMA_BIND_FAILURE)."""


def choose_node(*, topology: HostTopology, rank: RankIdentity, accelerator: Optional[Accelerator],
                policy: PlacementPolicy) -> NodeChoice:
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
        return NodeChoice(node=node, reasons=(f"node {node} from --numa-node (GPU {rank.gpu_id})",))
    if not policy.auto_numa_bind:
        return NodeChoice(node=None, reasons=("no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding",))
    if accelerator is None:
        return NodeChoice(node=None, reasons=("no accelerator identified for this rank",), failure=True)
    if accelerator.pci is None:
        return NodeChoice(
            node=None,
            reasons=(f"GPU {accelerator.gpu_id} ({accelerator.physical_id}): no PCI address ({accelerator.source})",),
            failure=True,
        )
    device = topology.pci_device(accelerator.pci)
    via = f"GPU {accelerator.gpu_id} is {accelerator.physical_id} at PCI {accelerator.pci} ({accelerator.source})"
    if device is None:
        return NodeChoice(node=None, reasons=(via, f"PCI {accelerator.pci} is not in {topology.root}"), failure=True)
    if device.numa_node is None:
        cpu_nodes = topology.cpu_nodes
        if len(cpu_nodes) == 1 and policy.affinity_mode == "exclusive":
            only = cpu_nodes[0].node_id
            return NodeChoice(
                node=only,
                reasons=(via, f"PCI {accelerator.pci} reports numa_node -1; node {only} is the only node with CPUs"),
            )
        return NodeChoice(
            node=None,
            reasons=(via, f"PCI {accelerator.pci} reports numa_node -1 (the kernel does not know its node)"),
        )
    return NodeChoice(node=device.numa_node, reasons=(via, f"node {device.numa_node} from PCI {accelerator.pci}"))


def split_exclusive(cpus: frozenset[int], *, topology: HostTopology, count: int) -> tuple[frozenset[int], ...]:
    """Split ``cpus`` into ``count`` disjoint, near-equal, contiguous slices, keeping SMT siblings together."""
    cores: list[frozenset[int]] = []
    seen: set[int] = set()
    for cpu_id in sorted(cpus):
        if cpu_id in seen:
            continue
        info = topology.cpu(cpu_id)
        siblings = (info.thread_siblings if info is not None and info.thread_siblings else frozenset({cpu_id})) & cpus
        siblings = siblings | {cpu_id}
        seen.update(siblings)
        cores.append(frozenset(siblings))
    units = cores if len(cores) >= count else [frozenset({c}) for c in sorted(cpus)]
    base, extra = divmod(len(units), count)
    slices = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        slices.append(frozenset().union(*units[start:start + size]) if size else frozenset())
        start += size
    return tuple(slices)


def _node_cpu_set(*, topology: HostTopology, node: NumaNode, policy: PlacementPolicy,
                  affinity: ProcessAffinity, exclusive_slice: Optional[tuple[int, int]]
                  ) -> tuple[frozenset[int], tuple[int, ...], Optional[tuple[int, ...]], list[str]]:
    """(cpus, memory nodes, whole nodes for --cpunodebind or None, reasons)."""
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
    mem_nodes = tuple(n.node_id for n in nodes if n.has_memory and n.node_id in affinity.mems)
    cpus = allowed
    whole: Optional[tuple[int, ...]] = tuple(n.node_id for n in nodes) if allowed == span else None
    if policy.affinity_mode == "exclusive" and exclusive_slice is not None and allowed:
        index, count = exclusive_slice
        slices = split_exclusive(allowed, topology=topology, count=count)
        cpus = slices[index]
        whole = None
        reasons.append(
            f"exclusive mode: slice {index + 1} of {count} of node {node.node_id}'s {len(allowed)} allowed CPUs"
        )
    return cpus, mem_nodes, whole, reasons


# ---------------------------------------------------------------------------------------------
# The decision


def placement_intent(
    *,
    topology: HostTopology,
    affinity: ProcessAffinity,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
    exclusive_slice: Optional[tuple[int, int]] = None,
    cpu_rank_set: Optional[frozenset[int]] = None,
) -> Union[PlacementIntent, ProcessPlacement]:
    """Where ``rank`` should run (an intent), or its unbound placement with the reason. Pure: probes nothing.

    ``exclusive_slice`` is (index, count) among the devices planned on the same node, for exclusive mode.
    ``cpu_rank_set`` is a CPU-device rank's CPUs from SGLANG_CPU_OMP_THREADS_BIND.
    """
    pci = accelerator.pci if accelerator is not None else None

    def unbound(reasons: Sequence[str], *, failure: bool) -> ProcessPlacement:
        if failure and policy.crash_on_failure:
            raise PlacementError(
                f"{rank.label}: cannot bind ({'; '.join(reasons)}); SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this "
                f"an error: fix the cause, or unset it to run unbound"
            )
        return ProcessPlacement(
            dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank, gpu_id=rank.gpu_id, pci=pci,
            numa_node=None, cpus=frozenset(), mem_nodes=frozenset(), mem_policy=MemPolicy.NONE, strategy=Strategy.NONE,
            reasons=tuple(reasons), launcher=policy.launcher, warning=failure,
        )

    def intent(node_id: int, cpus: frozenset[int], mem_nodes: tuple[int, ...], whole: Optional[tuple[int, ...]],
               reasons: list[str]) -> PlacementIntent:
        if not mem_nodes:
            reasons.append(f"no memory node this process may use near node {node_id}: CPU binding only")
        return PlacementIntent(rank=rank, pci=pci, node_id=node_id, cpus=cpus, mem_nodes=mem_nodes,
                               whole_nodes=whole, reasons=tuple(reasons))

    if policy.device == "cpu":
        if cpu_rank_set is None:
            raise ValueError(f"{rank.label}: a CPU-device rank needs its CPUs from SGLANG_CPU_OMP_THREADS_BIND")
        cpus = cpu_rank_set & affinity.cpus
        counts: dict[int, int] = {}
        for node in topology.nodes:
            shared = len(node.cpus & cpus)
            if shared:
                counts[node.node_id] = shared
        node_id = max(counts, key=lambda n: (counts[n], -n)) if counts else None
        spec = policy.cpu_threads_bind.strip()
        reasons = [
            f"CPU rank {rank.global_rank}: CPUs {format_cpulist(cpus)} from SGLANG_CPU_OMP_THREADS_BIND="
            f"{'all (one node per rank)' if spec == 'all' else repr(spec)}"
        ]
        if not cpus or node_id is None:
            return unbound(reasons + ["none of these CPUs may be used by this process"], failure=True)
        mem_nodes = tuple(
            n for n in sorted(counts)
            if (nn := topology.node(n)) is not None and nn.has_memory and n in affinity.mems
        )
        whole = tuple(sorted(counts)) if cpus == frozenset().union(
            *(topology.node(n).cpus for n in counts)) else None
        return intent(node_id, cpus, mem_nodes, whole, reasons)

    choice = choose_node(topology=topology, rank=rank, accelerator=accelerator, policy=policy)
    reasons = list(choice.reasons)
    if choice.node is None:
        return unbound(reasons, failure=choice.failure)
    node = topology.node(choice.node)
    if node is None:
        return unbound(reasons + [f"node {choice.node} does not exist on this host"], failure=True)
    if not node.has_cpus:
        return unbound(reasons + [f"node {node.node_id} has memory but no CPUs"], failure=True)
    if (
        policy.affinity_mode == "node"
        and policy.numa_nodes is None
        and len(topology.cpu_nodes) == 1
    ):
        return unbound(
            reasons + ["this host has one NUMA node with CPUs: node binding cannot help "
                       "(exclusive mode still splits it between ranks)"],
            failure=False,
        )
    cpus, mem_nodes, whole, cpu_reasons = _node_cpu_set(
        topology=topology, node=node, policy=policy, affinity=affinity, exclusive_slice=exclusive_slice
    )
    reasons.extend(cpu_reasons)
    if not cpus:
        return unbound(
            reasons + [f"{affinity.source} allows none of node {node.node_id}'s CPUs "
                       f"({format_cpulist(node.cpus)}; allowed {format_cpulist(affinity.cpus)})"],
            failure=True,
        )
    return intent(node.node_id, cpus, mem_nodes, whole, reasons)


def resolve_placement(
    *,
    topology: HostTopology,
    affinity: ProcessAffinity,
    rank: RankIdentity,
    accelerator: Optional[Accelerator],
    policy: PlacementPolicy,
    capabilities: HostCapabilities,
    exclusive_slice: Optional[tuple[int, int]] = None,
    cpu_rank_set: Optional[frozenset[int]] = None,
) -> ProcessPlacement:
    """Where ``rank`` runs and how that is applied: its intent, then the strategy ``capabilities`` allow."""
    decided = placement_intent(topology=topology, affinity=affinity, rank=rank, accelerator=accelerator,
                               policy=policy, exclusive_slice=exclusive_slice, cpu_rank_set=cpu_rank_set)
    if isinstance(decided, ProcessPlacement):
        return decided
    return choose_strategy(decided, policy=policy, capabilities=capabilities)


# ---------------------------------------------------------------------------------------------
# A host's ranks


LIVE_RUNTIME = "live"
"""plan_engine's default runtime: NVML when planning this host's own /sys, nothing for a snapshot."""


def _runtime_for(runtime, *, device: str, topology: HostTopology, gpus: Optional[Sequence[str]]):
    if runtime != LIVE_RUNTIME:
        return runtime
    if device == "cpu" or gpus is not None or os.path.realpath(topology.root) != "/sys":
        return None
    from sglang.srt.placement.devices import default_runtime

    return default_runtime(device)


def _host_facts(topology: Optional[HostTopology], affinity: Optional[ProcessAffinity],
                capabilities: Optional[HostCapabilities]) -> tuple[HostTopology, ProcessAffinity, HostCapabilities]:
    """The given host facts, each missing one read from this host (topology from SGLANG_SYSFS_ROOT)."""
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    return (
        topology if topology is not None else read_topology(settings.sysfs_root()),
        affinity if affinity is not None else read_process_affinity(),
        capabilities if capabilities is not None else HostCapabilities.live(),
    )


@dataclass(frozen=True)
class _Planned:
    """One entry to plan: a rank, its device, and what tells exclusive slices apart (its device, or itself)."""

    rank: RankIdentity
    accelerator: Optional[Accelerator]
    slice_key: Hashable


def _plan(server_args, entries: Sequence[_Planned], *, topology: HostTopology, affinity: ProcessAffinity,
          policy: PlacementPolicy, capabilities: HostCapabilities,
          only: Optional[int] = None) -> tuple[ProcessPlacement, ...]:
    """The one planning core: CPU groups, exclusive slices among the entries, each intent, then its strategy.

    Exclusive slices count distinct ``slice_key`` values per node, so entries that
    are alternatives for one device (a rank's candidate GPUs) share its slice.
    Only the entry at ``only`` (all when None) is probed and returned.
    """
    cpu_sets: dict[RankIdentity, frozenset[int]] = {}
    if policy.device == "cpu":
        groups = validate_cpu_threads_bind(
            policy.cpu_threads_bind, world_size=world_size(server_args), topology=topology, affinity=affinity
        )
        cpu_sets = {e.rank: groups[e.rank.global_rank] for e in entries}

    slices: dict[Hashable, tuple[int, int]] = {}
    if policy.affinity_mode == "exclusive" and policy.device != "cpu":
        by_node: dict[int, list[Hashable]] = {}
        for e in entries:
            choice = choose_node(topology=topology, rank=e.rank, accelerator=e.accelerator, policy=policy)
            members = by_node.setdefault(choice.node, []) if choice.node is not None else None
            if members is not None and e.slice_key not in members:
                members.append(e.slice_key)
        for members in by_node.values():
            for index, key in enumerate(members):
                slices[key] = (index, len(members))

    return tuple(
        resolve_placement(
            topology=topology, affinity=affinity, rank=e.rank, accelerator=e.accelerator, policy=policy,
            capabilities=capabilities, exclusive_slice=slices.get(e.slice_key), cpu_rank_set=cpu_sets.get(e.rank),
        )
        for index, e in enumerate(entries)
        if only is None or index == only
    )


def plan_engine(
    server_args,
    *,
    launcher: str = "mp",
    topology: Optional[HostTopology] = None,
    affinity: Optional[ProcessAffinity] = None,
    capabilities: Optional[HostCapabilities] = None,
    accelerators: Optional[Sequence[Accelerator]] = None,
    gpus: Optional[Sequence[str]] = None,
    env: Optional[Mapping[str, str]] = None,
    runtime=LIVE_RUNTIME,
    affinity_mode: Optional[str] = None,
    exec_supported: bool = True,
    only: Optional[int] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs (``local_ranks``), resolved against this host (or the given topology).

    Each rank's device comes from ``env`` (the environment the ranks inherit:
    ``CUDA_VISIBLE_DEVICES`` / ``ZE_AFFINITY_MASK``). ``only`` resolves just the rank at
    that index (its neighbours still shape exclusive slices), so a rank resolving
    itself probes numactl for its own options alone.
    """
    from sglang.srt.placement.devices import identify_accelerators

    topology, affinity, capabilities = _host_facts(topology, affinity, capabilities)
    policy = PlacementPolicy.from_env(
        server_args, launcher=launcher, affinity_mode=affinity_mode, exec_supported=exec_supported
    )
    ranks = local_ranks(server_args)
    found: Sequence[Optional[Accelerator]] = [None] * len(ranks)
    if policy.device != "cpu":
        found = accelerators if accelerators is not None else identify_accelerators(
            device=policy.device, topology=topology, gpu_ids=[r.gpu_id for r in ranks],
            env=os.environ if env is None else env, gpus=gpus,
            runtime=_runtime_for(runtime, device=policy.device, topology=topology, gpus=gpus),
        )
    entries = [_Planned(rank=r, accelerator=a, slice_key=index) for index, (r, a) in enumerate(zip(ranks, found))]
    return _plan(server_args, entries, topology=topology, affinity=affinity, policy=policy,
                 capabilities=capabilities, only=only)


def plan_node(
    server_args,
    *,
    ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
    launcher: str = "ray",
    policy: Optional[PlacementPolicy] = None,
    topology: Optional[HostTopology] = None,
    affinity: Optional[ProcessAffinity] = None,
    capabilities: Optional[HostCapabilities] = None,
    gpus: Optional[Sequence[str]] = None,
    runtime=LIVE_RUNTIME,
    affinity_mode: Optional[str] = None,
    exec_supported: bool = True,
) -> tuple[ProcessPlacement, ...]:
    """One placement per (rank, accelerator id) pair, all ranks of one node resolved together, on that node.

    Each id is the physical device the launcher knows the rank gets (Ray's
    accelerator id: an index or a UUID), never read from the calling process's
    ``CUDA_VISIBLE_DEVICES``: the caller (a Ray task) holds no accelerator. A rank
    may appear with several candidate ids (Ray picks among a bundle's GPUs only
    when the actor starts); each pair gets its own placement, and they share
    exclusive slices by device, so the caller can compare them. ``policy`` is
    the engine's (the driver's settings); without it, this process's settings
    with ``launcher``, ``affinity_mode`` and ``exec_supported`` are used.
    """
    from sglang.srt.placement.devices import DeviceIdentityError

    topology, affinity, capabilities = _host_facts(topology, affinity, capabilities)
    if policy is None:
        policy = PlacementPolicy.from_env(
            server_args, launcher=launcher, affinity_mode=affinity_mode, exec_supported=exec_supported
        )
    runtime = _runtime_for(runtime, device=policy.device, topology=topology, gpus=gpus)
    entries: list[_Planned] = []
    for index, (rank, accelerator_id) in enumerate(ranks_with_ids):
        if policy.device == "cpu":
            entries.append(_Planned(rank=rank, accelerator=None, slice_key=index))
            continue
        if accelerator_id is None or not str(accelerator_id).strip():
            raise DeviceIdentityError(
                f"{rank.label}: no accelerator id was given for a --device {policy.device} rank; give each rank "
                f"the id its launcher assigns (in Ray, the rank's bundle must hold one GPU: {{'GPU': 1}})."
            )
        accelerator = _accelerator_of_id(str(accelerator_id).strip(), rank=rank, device=policy.device,
                                         topology=topology, gpus=gpus, runtime=runtime)
        entries.append(_Planned(rank=rank, accelerator=accelerator,
                                slice_key=accelerator.pci or accelerator.physical_id))
    return _plan(server_args, entries, topology=topology, affinity=affinity, policy=policy,
                 capabilities=capabilities)


def _accelerator_of_id(accelerator_id: str, *, rank: RankIdentity, device: str, topology: HostTopology,
                       gpus: Optional[Sequence[str]], runtime) -> Accelerator:
    """The device behind a launcher-assigned physical id, labelled with the rank's own logical index."""
    from sglang.srt.placement.devices import DeviceIdentityError, identify_accelerators

    if gpus is not None:
        # --gpus lists PCI addresses by physical device index, which is what an index id names.
        if not accelerator_id.isdigit():
            raise DeviceIdentityError(
                f"{rank.label}: --gpus lists devices by index, but the rank's device is {accelerator_id!r}; "
                f"drop --gpus to identify it through NVML or sysfs."
            )
        (found,) = identify_accelerators(device=device, topology=topology, gpu_ids=[int(accelerator_id)],
                                         env=os.environ, gpus=gpus)
    else:
        (found,) = identify_accelerators(device=device, topology=topology, gpu_ids=[0], env=os.environ,
                                         ray_accelerator_ids=[accelerator_id], runtime=runtime)
    return Accelerator(gpu_id=rank.gpu_id, physical_id=accelerator_id, pci=found.pci, source=found.source)


def resolve_rank(
    server_args,
    *,
    dp_rank: int,
    pp_rank: int,
    tp_rank: int,
    launcher: str,
    gpu_id: Optional[int] = None,
    ray_accelerator_ids: Optional[Sequence[str]] = None,
    **plan_kwargs,
) -> ProcessPlacement:
    """One rank's placement, resolved on the host where this is called, its neighbours in view.

    With ``ray_accelerator_ids`` (the ids an actor holds; the rank uses the first)
    the rank is planned alone through ``plan_node``: a Ray launcher resolves all
    of a node's ranks together with ``plan_node`` instead.
    """
    ranks = local_ranks(server_args)
    for index, rank in enumerate(ranks):
        if (rank.dp_rank, rank.pp_rank, rank.tp_rank) == (dp_rank, pp_rank, tp_rank):
            break
    else:
        raise ValueError(
            f"DP{dp_rank} PP{pp_rank} TP{tp_rank} is not a rank of node {server_args.node_rank} "
            f"({_layout(server_args)})"
        )
    if gpu_id is not None and gpu_id != rank.gpu_id:
        raise ValueError(f"{rank.label} uses GPU {rank.gpu_id}, not GPU {gpu_id} ({_layout(server_args)})")
    if ray_accelerator_ids:
        plan_kwargs.pop("env", None)  # the id is explicit; no environment names the device
        (placement,) = plan_node(server_args, ranks_with_ids=[(rank, str(ray_accelerator_ids[0]))],
                                 launcher=launcher, **plan_kwargs)
        return placement
    (placement,) = plan_engine(server_args, launcher=launcher, only=index, **plan_kwargs)
    return placement


def rank_of_gpu(server_args, gpu_id: int) -> RankIdentity:
    """The local rank that uses GPU ``gpu_id`` (upstream's helpers are called with a GPU id, not a rank)."""
    for rank in local_ranks(server_args):
        if rank.gpu_id == gpu_id:
            return rank
    used = sorted(r.gpu_id for r in local_ranks(server_args) if r.gpu_id is not None)
    raise ValueError(
        f"no rank of node {server_args.node_rank} uses GPU {gpu_id} ({_layout(server_args)} uses GPUs "
        f"{format_cpulist(used) or 'none'}); check --base-gpu-id and --gpu-id-step"
    )


def device_numa_node(server_args, *, gpu_id: int, topology: Optional[HostTopology] = None,
                     env: Optional[Mapping[str, str]] = None, runtime=LIVE_RUNTIME) -> NodeChoice:
    """The NUMA node placement would choose for GPU ``gpu_id``, and why; probes and binds nothing."""
    from sglang.srt.placement.devices import identify_accelerators

    if topology is None:
        from sglang.srt.placement.topology import read_topology

        topology = read_topology(settings.sysfs_root())
    policy = PlacementPolicy.from_env(server_args, launcher="mp")
    rank = rank_of_gpu(server_args, gpu_id)
    (accelerator,) = identify_accelerators(
        device=policy.device, topology=topology, gpu_ids=[gpu_id], env=os.environ if env is None else env,
        runtime=_runtime_for(runtime, device=policy.device, topology=topology, gpus=None),
    )
    return choose_node(topology=topology, rank=rank, accelerator=accelerator, policy=policy)


def _layout(server_args) -> str:
    return (f"tp={server_args.tp_size}, pp={server_args.pp_size}, dp={server_args.dp_size}, "
            f"nnodes={server_args.nnodes}")


def log_placements(placements: Iterable[ProcessPlacement]) -> None:
    """One line per rank: what will be bound and why; a warning for a rank left unbound by a fault."""
    for p in placements:
        line = describe(p)
        if p.warning:
            logger.warning(line)
        else:
            logger.info(line)


def describe(p: ProcessPlacement) -> str:
    """The one-line human form of a placement."""
    gpu = f" GPU {p.gpu_id}" if p.gpu_id is not None else ""
    pci = f" ({p.pci})" if p.pci else ""
    if p.strategy == Strategy.NONE:
        head = f"[{p.label}]{gpu}{pci}: not bound"
    else:
        mem = {"bind": f"membind {format_cpulist(p.mem_nodes)}",
               "preferred": f"preferred {format_cpulist(p.mem_nodes)}",
               "none": "memory unbound"}[p.mem_policy]
        head = f"[{p.label}]{gpu}{pci}: node {p.numa_node} CPUs {format_cpulist(p.cpus)} {mem} via {p.strategy}"
    return f"{head} -- {'; '.join(p.reasons)}"
