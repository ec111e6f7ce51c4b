"""The one decision of where a rank runs and how, for every launcher and strategy.

The steps are upstream's (``configure_subprocess``): the GPU's NUMA node, the rank's
CPUs and memory as numactl options, the memory-policy check, numactl's probe. A
``Host`` answers each for the host the rank runs on: ``numa_utils`` with upstream's
helpers for the live host, the operator tools for a snapshot. The rule for settings
that meet (``strategy_for``, and ``_without_node``):

* ``--numa-node`` (else discovery) picks the node; SGLANG_SET_CPU_AFFINITY=1 picks the
  rank's slice of that node's cores (``share.node_share``);
* SGLANG_NUMA_BIND_V2=0: the legacy bind applies the same CPUs, with preferred memory,
  in ``configure_scheduler_process``;
* a Ray actor binds itself there (it cannot start under numactl); a spawned rank
  starts under numactl, and ``configure_scheduler_process`` leaves it as it is;
* no node known: SGLANG_SET_CPU_AFFINITY=1 keeps upstream's NUMA-blind slice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Protocol

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.numactl import cpu_mem_args, parse_args
from sglang.srt.placement.settings import (
    PlacementPolicy,
    rank_cpus,
    shared_cpus,
    spawn_places_cpu_rank,
)
from sglang.srt.placement.share import (
    Share,
    Slot,
    node_share,
    upstream_slice,
    upstream_slice_reason,
)
from sglang.srt.placement.types import (
    HostTopology,
    Launcher,
    MemPolicy,
    NodeChoice,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

_SECCOMP = (
    "(e.g. set_mempolicy/sched_setaffinity blocked by seccomp, or cpuset rejects "
    "the policy)"
)


class Host(Protocol):
    """What the decision asks of the host where the rank runs."""

    numactl_path: Optional[str]  # the numactl probed, which a spawn execs
    libnuma: bool  # whether the rank can set a memory policy in-process

    def topology(self) -> HostTopology: ...
    def affinity(self) -> ProcessAffinity: ...
    def numa_node(self, rank: RankIdentity) -> NodeChoice: ...
    def node_cpus(self, node: int) -> frozenset[int]: ...
    def node_gpus(self, node: int) -> tuple[str, ...]: ...  # PCI addresses, in order
    def gpu_pci(self, rank: RankIdentity) -> Optional[str]: ...
    def can_set_mempolicy(self) -> bool: ...
    def probe(self, numactl_args: str) -> tuple[Optional[str], str]: ...
    def fail(self, node: Optional[int], reason: str) -> None: ...
    def cpu_counts(self) -> tuple[int, int]: ...  # physical cores, logical CPUs


def strategy_for(policy: PlacementPolicy, *, located: bool) -> Strategy:
    """How a rank is bound; ``located``: its node (a CPU rank: its CPUs) is known."""
    if not located:
        return Strategy.CPU_AFFINITY if policy.set_cpu_affinity else Strategy.NONE
    if not policy.bind_v2:
        return Strategy.V1
    return Strategy.IN_PROCESS if policy.launcher is Launcher.RAY else Strategy.EXEC


def resolve_placement(
    *,
    rank: RankIdentity,
    policy: PlacementPolicy,
    host: Host,
    node: Optional[NodeChoice] = None,
) -> ProcessPlacement:
    """Where ``rank`` runs and how, from ``host``'s answers.

    Args:
        rank: the rank and its device, in the numbering its launcher uses.
        policy: the settings and ServerArgs fields that decide.
        host: the answers of the host the rank runs on.
        node: the node choice, when the caller asked ``host`` already.

    Returns:
        The placement. A failed step has called ``host.fail`` (a WARNING, or an error
        under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1) and leaves it degraded.
    """
    placed = ProcessPlacement(rank, launcher=policy.launcher)
    if why := policy.why_unplaced:
        return _without_node(placed, (why,), policy, host)
    if policy.device == "cpu":
        return _cpu_rank(placed, policy, host)
    choice = node or host.numa_node(rank)
    placed = replace(placed, pci=choice.pci, degraded=choice.degraded)
    if choice.node is None:
        return _without_node(placed, choice.reasons, policy, host)
    reasons = choice.reasons
    share = gpu_share(choice.node, rank=rank, policy=policy, host=host)
    if not share.cpus and (share.degraded or host.node_cpus(choice.node)):
        return replace(placed, reasons=(*reasons, *share.reasons), degraded=True)
    strategy = strategy_for(policy, located=True)
    mem = frozenset([choice.node])
    return _bind(placed, choice.node, share, mem, strategy, host, reasons)


def gpu_share(
    node: int, *, rank: RankIdentity, policy: PlacementPolicy, host: Host
) -> Share:
    """The CPUs of ``node`` the GPU rank gets (none: the failure policy has run)."""
    node_cpus, allowed = host.node_cpus(node), host.affinity().cpus
    if not node_cpus and host.topology().node(node) is None:
        nodes = format_cpulist(host.topology().node_ids)
        why = f"NUMA node {node} does not exist on this host (nodes {nodes})"
        host.fail(node, f"{why}, skipping NUMA binding for {rank.label}.")
        return Share(frozenset(), False, (why,), degraded=True)
    slot, cores = None, None
    if policy.set_cpu_affinity and node_cpus & allowed:
        slot = _slot(node, rank, policy, host)
        cores = host.topology().cores_within(node_cpus & allowed)
    share = node_share(
        node=node, node_cpus=node_cpus, allowed=allowed, cores=cores, slot=slot
    )
    if node_cpus and not share.cpus:
        why = (
            f"NUMA node {node} has no CPU cores allowed by the current affinity "
            f"{sorted(allowed)}, skipping NUMA binding for {rank.label}."
        )
        host.fail(node, why)
        return replace(share, reasons=(why,), degraded=True)
    if slot is None and policy.set_cpu_affinity and share.cpus:
        gpus = ", ".join(host.node_gpus(node)) or "none"
        why = (
            f"SGLANG_SET_CPU_AFFINITY=1: {rank.label} is not among node {node}'s GPUs "
            f"in sysfs ({gpus}), so it takes the whole node"
        )
        host.fail(node, why)
        return replace(share, reasons=(why,), degraded=True)
    return share


def _slot(
    node: int, rank: RankIdentity, policy: PlacementPolicy, host: Host
) -> Optional[Slot]:
    index = rank.device.index if rank.device else -1
    if policy.numa_nodes is not None:
        ids = [gpu for gpu, listed in enumerate(policy.numa_nodes) if listed == node]
        if index not in ids:
            return None
        why = f"{rank.device.label}, one of GPUs {format_cpulist(ids)} on node {node}"
        return Slot(ids.index(index), len(ids), f"{why} by --numa-node,")
    gpus, pci = host.node_gpus(node), host.gpu_pci(rank)
    if pci not in gpus:
        return None
    at = gpus.index(pci)
    why = f"GPU {pci}, {at + 1} of the {len(gpus)} GPUs on node {node} (PCI order),"
    return Slot(at, len(gpus), why)


def _cpu_rank(
    placed: ProcessPlacement, policy: PlacementPolicy, host: Host
) -> ProcessPlacement:
    """A CPU-device rank: the CPUs SGLANG_CPU_OMP_THREADS_BIND gives its index, memory
    on the nodes of those CPUs."""
    index, spec = placed.rank.device.index, policy.cpu_threads_bind.strip()
    topology, affinity = host.topology(), host.affinity()
    cpus = rank_cpus(spec, index=index, topology=topology, affinity=affinity)
    shown = "all (one node per rank)" if spec == "all" else repr(spec)
    reasons = (
        f"CPU rank {index}: CPUs {format_cpulist(cpus)} from "
        f"SGLANG_CPU_OMP_THREADS_BIND={shown}",
    )
    if note := shared_cpus(spec, index=index):
        reasons += (note,)
    if not policy.bind_v2:
        why = (
            "SGLANG_NUMA_BIND_V2=0: the spawn is not bound (upstream behaviour); only "
            "bootstrap's init_cpu_threads_env pins OpenMP threads on AMX or arm64 hosts"
        )
        return _without_node(placed, (*reasons, why), policy, host)
    if not spawn_places_cpu_rank(spec, topology):
        why = "this host has one NUMA node with CPUs: binding a rank to all of it "
        why += "cannot help"
        return _without_node(placed, (*reasons, why), policy, host)
    counts = {n.node_id: len(n.cpus & cpus) for n in topology.cpu_nodes_within(cpus)}
    node = max(counts, key=lambda n: (counts[n], -n))
    whole = len(counts) == 1 and topology.node(node).cpus == cpus
    strategy = strategy_for(policy, located=True)
    share = Share(cpus, whole)
    return _bind(placed, node, share, frozenset(counts), strategy, host, reasons)


def _without_node(
    placed: ProcessPlacement,
    reasons: tuple[str, ...],
    policy: PlacementPolicy,
    host: Host,
) -> ProcessPlacement:
    """No node: unbound, or under SGLANG_SET_CPU_AFFINITY=1 upstream's own slice."""
    device = placed.rank.device
    if strategy_for(policy, located=False) is Strategy.NONE or device is None:
        return replace(placed, reasons=reasons)
    physical, logical = host.cpu_counts()
    cpus = upstream_slice(
        device.index,
        tp_per_node=policy.tp_per_node,
        physical_cores=physical,
        logical_cpus=logical,
    )
    why = upstream_slice_reason(device.index, cpus)
    return replace(
        placed, cpus=cpus, strategy=Strategy.CPU_AFFINITY, reasons=(*reasons, why)
    )


def _bind(
    placed: ProcessPlacement,
    node: int,
    share: Share,
    mem: frozenset[int],
    strategy: Strategy,
    host: Host,
    reasons: tuple[str, ...],
) -> ProcessPlacement:
    """``share`` and memory on ``mem``, applied by ``strategy``."""
    reasons = (*reasons, *share.reasons)
    allowed = host.affinity().mems
    if mem and not mem & allowed:
        reasons += (
            f"node(s) {format_cpulist(mem)} hold no memory this process may use "
            f"(Mems_allowed {format_cpulist(allowed)}): CPU binding only",
        )
    mem = mem & allowed
    if mem and not host.can_set_mempolicy():
        mem = frozenset()
        reasons += (
            "NUMA memory policy not permitted: CPU binding only (with docker, "
            "--cap-add SYS_NICE also binds memory)",
        )
    cpus = share.cpus or host.node_cpus(node)
    placed = replace(
        placed,
        numa_node=node,
        cpus=cpus,
        mem_nodes=mem,
        mem_policy=MemPolicy.BIND if mem else MemPolicy.NONE,
        strategy=strategy,
        degraded=placed.degraded or share.degraded,
    )
    if strategy is Strategy.V1:
        why = (
            "SGLANG_NUMA_BIND_V2=0: the legacy bind in configure_scheduler_process "
            "(these CPUs, preferred memory)"
        )
        policy = MemPolicy.PREFERRED if mem else MemPolicy.NONE
        mem = frozenset([node]) if mem else mem
        return replace(
            placed, mem_policy=policy, mem_nodes=mem, reasons=(*reasons, why)
        )
    if strategy is Strategy.IN_PROCESS:
        why = (
            f"the {placed.launcher} launcher cannot start this rank under numactl: it "
            "binds itself in configure_scheduler_process"
        )
        if mem and not host.libnuma:
            why += "; libnuma is not available: CPU affinity only"
            placed = replace(placed, mem_nodes=frozenset(), mem_policy=MemPolicy.NONE)
        return replace(placed, reasons=(*reasons, why))
    return _exec(placed, share, reasons, host)


def _exec(
    placed: ProcessPlacement, share: Share, reasons: tuple[str, ...], host: Host
) -> ProcessPlacement:
    """Under the strongest numactl form the kernel accepts, else unbound."""
    node = placed.numa_node
    wanted = cpu_mem_args(
        node=node, cpus=share.cpus, whole_node=share.whole, mem_nodes=placed.mem_nodes
    )
    accepted, error = host.probe(wanted)
    if accepted is None and host.numactl_path is None:
        error = "numactl is not installed (apt-get install numactl)"
    if accepted is None:
        why = (
            f"numactl could not apply NUMA binding for node {node} {_SECCOMP}"
            f"{f': {error}' if error else ''}; skipping NUMA binding for "
            f"{placed.label}."
        )
        host.fail(node, why)
        unbound = ProcessPlacement(placed.rank, placed.pci, launcher=placed.launcher)
        return replace(unbound, reasons=(*reasons, why), degraded=True)
    bound = parse_args(accepted)
    if accepted != wanted:
        reasons += (f"numactl refused {wanted!r}; it accepts {accepted!r}",)
    return replace(
        placed,
        mem_policy=bound.mem_policy,
        mem_nodes=bound.mem_nodes,
        strategy=Strategy.EXEC,
        numactl_args=tuple(accepted.split()),
        numactl_path=host.numactl_path,
        reasons=(*reasons, f"exec under numactl {accepted}"),
        degraded=placed.degraded or bound.mem_policy != placed.mem_policy,
    )
