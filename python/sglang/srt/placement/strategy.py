"""How a rank's placement intent is applied here: numactl's probe ladder picks exec, else in-process or legacy V1.

``resolve`` decides where a rank should run from host facts and policy alone
(a :class:`PlacementIntent`); this step is the only one that asks the host
anything (it runs ``numactl <options> true``, cached per option set), so the
decision stays pure and the probing happens once, where the rank will run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from sglang.srt.placement.numactl import (
    AssumedNumactl,
    NumactlProber,
    cpu_option,
    default_prober,
)
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.types import (
    MemPolicy,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

Prober = Union[NumactlProber, AssumedNumactl]


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


@dataclass(frozen=True)
class PlacementIntent:
    """Where a rank should run, decided from host facts and policy alone: node, CPUs, memory nodes and why."""

    rank: RankIdentity
    pci: Optional[str]
    node_id: int
    cpus: frozenset[int]
    mem_nodes: tuple[int, ...]
    """Memory nodes to bind to; empty when no node near ``node_id`` has memory this process may use."""
    whole_nodes: Optional[tuple[int, ...]]
    """The nodes whose CPUs are exactly ``cpus`` (numactl --cpunodebind), or None (--physcpubind)."""
    reasons: tuple[str, ...]
    warning: bool = False
    """The affinity mode could not give what it asks (see ``reasons``)."""

    @property
    def mem_policy(self) -> MemPolicy:
        return MemPolicy.BIND if self.mem_nodes else MemPolicy.NONE


def choose_strategy(
    intent: PlacementIntent, *, policy: PlacementPolicy, capabilities: HostCapabilities
) -> ProcessPlacement:
    """The placement that applies ``intent``: exec under the strongest numactl form the kernel accepts, else
    in-process (libnuma), or the legacy V1 bind under SGLANG_NUMA_BIND_V2=0."""
    rank, node_id, mem_nodes = intent.rank, intent.node_id, intent.mem_nodes
    reasons = list(intent.reasons)

    def placed(
        strategy: Strategy,
        mem_policy: MemPolicy,
        nodes: tuple[int, ...],
        args: tuple[str, ...] = (),
        warning: bool = False,
    ) -> ProcessPlacement:
        return ProcessPlacement(
            rank=rank,
            pci=intent.pci,
            numa_node=node_id,
            cpus=intent.cpus,
            mem_nodes=frozenset(nodes) if mem_policy != MemPolicy.NONE else frozenset(),
            mem_policy=mem_policy,
            strategy=strategy,
            reasons=tuple(reasons),
            numactl_args=args,
            launcher=policy.launcher,
            warning=warning or intent.warning,
        )

    if not policy.bind_v2:
        reasons.append(
            "SGLANG_NUMA_BIND_V2=0: legacy V1 bind inside the child "
            "(numa_run_on_node + numa_set_preferred)"
        )
        return placed(
            Strategy.V1,
            MemPolicy.PREFERRED if mem_nodes else MemPolicy.NONE,
            (node_id,),
        )

    if policy.exec_supported and capabilities.numactl is not None:
        outcome = capabilities.numactl.ladder(
            cpu_args=(cpu_option(cpus=intent.cpus, whole_nodes=intent.whole_nodes),),
            mem_policy=intent.mem_policy,
            mem_nodes=mem_nodes,
            preferred_node=node_id if mem_nodes else None,
        )
        if outcome.ok:
            reasons.extend(outcome.reasons)
            degraded = outcome.mem_policy != intent.mem_policy
            nodes = (
                (node_id,) if outcome.mem_policy == MemPolicy.PREFERRED else mem_nodes
            )
            reasons.append(f"exec under numactl {' '.join(outcome.args)}")
            return placed(
                Strategy.EXEC,
                MemPolicy(outcome.mem_policy),
                nodes,
                outcome.args,
                warning=degraded,
            )
        refusal = f": {outcome.reasons[0]}" if outcome.reasons else ""
        reasons.append(
            f"numactl could not apply NUMA binding for node {node_id} (e.g. set_mempolicy/sched_setaffinity "
            f"blocked by seccomp, or cpuset rejects the policy){refusal}"
        )
    elif policy.exec_supported:
        reasons.append("numactl is not installed")
    else:
        reasons.append(
            f"the {policy.launcher} launcher cannot start this rank under numactl"
        )

    if not policy.in_process_supported:
        # sglang's spawned scheduler runs sglang's own code: nothing would apply an in-process bind.
        reasons.append(
            f"the {policy.launcher} launcher binds only by exec: running unbound"
        )
        return ProcessPlacement.unbound(
            rank,
            reasons=reasons,
            launcher=policy.launcher,
            failure=True,
            pci=intent.pci,
        )
    if capabilities.libnuma:
        reasons.append("in-process bind with libnuma")
        return placed(Strategy.IN_PROCESS, intent.mem_policy, mem_nodes)
    reasons.append("libnuma is not available: in-process CPU affinity only")
    return placed(
        Strategy.IN_PROCESS,
        MemPolicy.NONE,
        (),
        warning=intent.mem_policy != MemPolicy.NONE,
    )
