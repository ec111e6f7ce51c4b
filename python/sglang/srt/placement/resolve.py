"""resolve_placement(): the pure decision of where one rank runs, and plan_engine() for a host's ranks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.numactl import AssumedNumactl, NumactlProber, cpu_option, default_prober
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

Prober = Union[NumactlProber, AssumedNumactl]


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


@dataclass(frozen=True)
class HostCapabilities:
    """What can apply a binding on the host: a numactl prober (or a stand-in for a snapshot) and libnuma."""

    numactl: Optional[Prober]
    libnuma: bool

    @classmethod
    def live(cls) -> "HostCapabilities":
        from sglang.srt.placement.libnuma import load_libnuma

        return cls(numactl=default_prober(), libnuma=load_libnuma() is not None)

    @classmethod
    def snapshot(cls, root: str) -> "HostCapabilities":
        return cls(numactl=AssumedNumactl(root=root), libnuma=True)


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
    """Where ``rank`` runs and how that is applied. Same inputs, same answer.

    ``exclusive_slice`` is (index, count) among this host's ranks on the same node, for exclusive mode.
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
        return _finish(rank=rank, pci=None, node_id=node_id, cpus=cpus, mem_nodes=mem_nodes, whole=whole,
                       reasons=reasons, policy=policy, capabilities=capabilities, topology=topology,
                       unbound=unbound)

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
    return _finish(rank=rank, pci=pci, node_id=node.node_id, cpus=cpus, mem_nodes=mem_nodes, whole=whole,
                   reasons=reasons, policy=policy, capabilities=capabilities, topology=topology, unbound=unbound)


def _finish(*, rank: RankIdentity, pci: Optional[str], node_id: int, cpus: frozenset[int],
            mem_nodes: tuple[int, ...], whole: Optional[tuple[int, ...]], reasons: list[str],
            policy: PlacementPolicy, capabilities: HostCapabilities, topology: HostTopology,
            unbound) -> ProcessPlacement:
    """Memory policy and strategy for a rank whose node and CPUs are known."""
    if mem_nodes:
        mem_policy = "bind"
    else:
        mem_policy = "none"
        reasons.append(f"no memory node this process may use near node {node_id}: CPU binding only")

    def placed(strategy: str, policy_name: str, nodes: Iterable[int], args: tuple[str, ...] = (),
               warning: bool = False) -> ProcessPlacement:
        return ProcessPlacement(
            dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank, gpu_id=rank.gpu_id, pci=pci,
            numa_node=node_id, cpus=cpus, mem_nodes=frozenset(nodes) if policy_name != "none" else frozenset(),
            mem_policy=policy_name, strategy=strategy, reasons=tuple(reasons), numactl_args=args,
            launcher=policy.launcher, warning=warning,
        )

    if not policy.bind_v2:
        reasons.append("SGLANG_NUMA_BIND_V2=0: legacy V1 bind inside the child "
                       "(numa_run_on_node + numa_set_preferred)")
        return placed("v1", "preferred" if mem_nodes else "none", (node_id,))

    if policy.exec_supported and capabilities.numactl is not None:
        outcome = capabilities.numactl.ladder(
            cpu_args=(cpu_option(cpus=cpus, whole_nodes=whole),),
            mem_policy=mem_policy, mem_nodes=mem_nodes, preferred_node=node_id if mem_nodes else None,
        )
        reasons.extend(outcome.reasons)
        if outcome.ok:
            if outcome.mem_policy == MemPolicy.PREFERRED:
                reasons.append(f"falling back to preferred node {node_id}")
                return placed("exec", "preferred", (node_id,), outcome.args, warning=True)
            degraded = outcome.mem_policy == MemPolicy.NONE and mem_policy != MemPolicy.NONE
            if degraded:
                reasons.append("falling back to CPU-only binding")
            reasons.append(f"exec under numactl {' '.join(outcome.args)}")
            return placed("exec", outcome.mem_policy, mem_nodes, outcome.args, warning=degraded)
    elif policy.exec_supported:
        reasons.append("numactl is not installed")
    else:
        reasons.append(f"the {policy.launcher} launcher cannot start this rank under numactl")

    if capabilities.libnuma:
        reasons.append("in-process bind with libnuma")
        return placed("in-process", mem_policy, mem_nodes)
    reasons.append("libnuma is not available: in-process CPU affinity only")
    return placed("in-process", "none", (), warning=mem_policy != MemPolicy.NONE)


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
    ray_accelerator_ids: Optional[Mapping[int, Sequence[str]]] = None,
    only: Optional[int] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs, resolved against this host (or the given topology).

    ``only`` resolves just the rank at that index of ``local_ranks`` (its neighbours still shape
    exclusive slices), so a rank resolving itself probes numactl for its own options alone.
    """
    from sglang.srt.placement.devices import identify_accelerators

    if topology is None:
        from sglang.srt.placement.topology import read_topology

        topology = read_topology(settings.sysfs_root())
    if affinity is None:
        from sglang.srt.placement.topology import read_process_affinity

        affinity = read_process_affinity()
    if capabilities is None:
        capabilities = HostCapabilities.live()
    policy = PlacementPolicy.from_env(
        server_args, launcher=launcher, affinity_mode=affinity_mode, exec_supported=exec_supported
    )
    ranks = local_ranks(server_args)
    env = os.environ if env is None else env
    runtime = _runtime_for(runtime, device=policy.device, topology=topology, gpus=gpus)

    accel_by_rank: dict[RankIdentity, Optional[Accelerator]] = {}
    if policy.device != "cpu":
        if accelerators is None:
            gpu_ids = [r.gpu_id for r in ranks]
            accelerators = identify_accelerators(
                device=policy.device, topology=topology, gpu_ids=gpu_ids, env=env, gpus=gpus, runtime=runtime
            )
        for rank, accel in zip(ranks, accelerators):
            accel_by_rank[rank] = accel
        if ray_accelerator_ids:
            for index, ids in ray_accelerator_ids.items():
                rank = ranks[index]
                (accel,) = identify_accelerators(
                    device=policy.device, topology=topology, gpu_ids=[0], env=env,
                    ray_accelerator_ids=ids, runtime=runtime,
                )
                accel_by_rank[rank] = Accelerator(
                    gpu_id=rank.gpu_id, physical_id=accel.physical_id, pci=accel.pci, source=accel.source
                )

    cpu_sets: dict[RankIdentity, frozenset[int]] = {}
    if policy.device == "cpu":
        groups = validate_cpu_threads_bind(
            policy.cpu_threads_bind, world_size=world_size(server_args), topology=topology, affinity=affinity
        )
        cpu_sets = {rank: groups[rank.global_rank] for rank in ranks}

    slices: dict[RankIdentity, tuple[int, int]] = {}
    if policy.affinity_mode == "exclusive" and policy.device != "cpu":
        by_node: dict[int, list[RankIdentity]] = {}
        for rank in ranks:
            choice = choose_node(topology=topology, rank=rank, accelerator=accel_by_rank.get(rank), policy=policy)
            if choice.node is not None:
                by_node.setdefault(choice.node, []).append(rank)
        for members in by_node.values():
            for index, rank in enumerate(members):
                slices[rank] = (index, len(members))

    return tuple(
        resolve_placement(
            topology=topology, affinity=affinity, rank=rank, accelerator=accel_by_rank.get(rank), policy=policy,
            capabilities=capabilities, exclusive_slice=slices.get(rank), cpu_rank_set=cpu_sets.get(rank),
        )
        for index, rank in enumerate(ranks)
        if only is None or index == only
    )


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
    """One rank's placement, resolved on the host where this is called (e.g. inside a Ray task on that node)."""
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
    ids = {index: list(ray_accelerator_ids)} if ray_accelerator_ids else None
    (placement,) = plan_engine(server_args, launcher=launcher, ray_accelerator_ids=ids, only=index, **plan_kwargs)
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
