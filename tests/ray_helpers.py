"""Scheduler targets and hand-made planners (``plan_node``'s signature) for the Ray launcher tests.

Ray workers cannot import the tests directory, so the tests register this
module with cloudpickle to ship it by value.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import ProcessPlacement, RankIdentity


def thread_cpus() -> dict[int, str]:
    """Cpus_allowed_list of every thread of this process."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/status", encoding="ascii") as f:
                text = f.read()
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(name)] = format_cpulist(parse_cpulist(line.split(":", 1)[1].strip()))
    return out


class ReportingScheduler:
    """Reports where its process runs: pid, every thread's CPUs, allowed memory nodes, the env it saw."""

    def __init__(self, *, server_args: Any, placement: ProcessPlacement, rank: RankIdentity) -> None:
        self.rank = rank
        self.loops = 0

    def ready_info(self) -> dict:
        with open("/proc/self/status", encoding="ascii") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        per_thread = thread_cpus()
        with open(f"/proc/{os.getppid()}/comm", encoding="ascii") as f:
            parent = f.read().strip()
        return {
            "pid": os.getpid(),
            "threads": len(per_thread),
            "thread_cpu_sets": sorted(set(per_thread.values())),
            "mems_allowed": status["Mems_allowed_list"].strip(),
            "omp_bind_env": os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"),
            "tp_rank": self.rank.tp_rank,
            "parent": parent,
        }

    def event_loop(self) -> None:
        self.loops += 1


def reporting_target(*, server_args: Any, placement: ProcessPlacement, rank: RankIdentity) -> ReportingScheduler:
    return ReportingScheduler(server_args=server_args, placement=placement, rank=rank)


def failing_target(*, server_args: Any, placement: ProcessPlacement, rank: RankIdentity) -> ReportingScheduler:
    if rank.tp_rank == 1:
        raise ValueError(f"boom in the constructor of TP{rank.tp_rank}")
    return ReportingScheduler(server_args=server_args, placement=placement, rank=rank)


def dying_target(*, server_args: Any, placement: ProcessPlacement, rank: RankIdentity) -> ReportingScheduler:
    os._exit(3)


def _hand_placement(rank: RankIdentity, *, strategy: str, numactl_args: Sequence[str] = ()) -> ProcessPlacement:
    cpu = rank.tp_rank % 2
    return ProcessPlacement(
        dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank, gpu_id=rank.gpu_id, pci=None,
        numa_node=0, cpus=frozenset({cpu}), mem_nodes=frozenset({0}), mem_policy="bind", strategy=strategy,
        reasons=(f"hand-made on pid {os.getpid()}",), numactl_args=tuple(numactl_args), launcher="ray",
    )


def hand_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]], policy: Any,
                 gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    """Rank TPn on CPU n % 2, memory bound to node 0; exec when the launcher can, else in-process."""
    if policy.exec_supported:
        return tuple(_hand_placement(rank, strategy="exec",
                                     numactl_args=(f"--physcpubind={rank.tp_rank % 2}", "--membind=0"))
                     for rank, _ in ranks_with_ids)
    return tuple(_hand_placement(rank, strategy="in-process") for rank, _ in ranks_with_ids)


def lying_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]], policy: Any,
                  gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    """Plans CPU tp % 2 but starts numactl on the other CPU: the actor runs where its placement does not say."""
    return tuple(_hand_placement(rank, strategy="exec",
                                 numactl_args=(f"--physcpubind={1 - rank.tp_rank % 2}", "--membind=0"))
                 for rank, _ in ranks_with_ids)


def refused_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]], policy: Any,
                    gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    """An exec placement numactl refuses on this host (memory node 7 does not exist)."""
    return tuple(_hand_placement(rank, strategy="exec",
                                 numactl_args=(f"--physcpubind={rank.tp_rank % 2}", "--membind=7"))
                 for rank, _ in ranks_with_ids)


def tree_cpus_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
                      policy: Any, gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    """plan_node with every online CPU of the node's (fake) tree allowed, as ``plan --sysfs-root`` treats a
    snapshot: the real process may use fewer, so slices of CPUs this host lacks can be planned."""
    from sglang.srt.placement import settings
    from sglang.srt.placement.resolve import plan_node
    from sglang.srt.placement.topology import read_topology
    from sglang.srt.placement.types import ProcessAffinity

    topology = read_topology(settings.sysfs_root())
    affinity = ProcessAffinity(cpus=topology.online_cpus, mems=frozenset(n.node_id for n in topology.nodes),
                               source="the node's tree (all online CPUs)")
    return plan_node(server_args, ranks_with_ids=ranks_with_ids, policy=policy, gpus=gpus, topology=topology,
                     affinity=affinity)


def failing_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
                    policy: Any, gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    raise ValueError("no plan on this node")


def sleeping_pid_file(node_id: str) -> str:
    """Where ``sleeping_planner`` on Ray node ``node_id`` writes its pid (a node id is unique to a cluster)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"sglang-sleeping-planner-{node_id}.pid")


def sleeping_planner(server_args: Any, *, ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
                     policy: Any, gpus: Any = None) -> tuple[ProcessPlacement, ...]:
    """Never answers in time; says which process it runs in, so a test can see it cancelled."""
    import time

    import ray

    with open(sleeping_pid_file(ray.get_runtime_context().get_node_id()), "w", encoding="ascii") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    raise AssertionError("the launch should have cancelled this task")
