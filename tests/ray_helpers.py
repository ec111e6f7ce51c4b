"""Scheduler targets and hand-made resolvers for the Ray launcher tests.

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


def _hand_placement(*, dp_rank: int, pp_rank: int, tp_rank: int, gpu_id: Optional[int], strategy: str,
                    numactl_args: Sequence[str] = ()) -> ProcessPlacement:
    cpu = tp_rank % 2
    return ProcessPlacement(
        dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id, pci=None, numa_node=0,
        cpus=frozenset({cpu}), mem_nodes=frozenset({0}), mem_policy="bind", strategy=strategy,
        reasons=(f"hand-made on pid {os.getpid()}",), numactl_args=tuple(numactl_args), launcher="ray",
    )


def hand_resolver(server_args: Any, *, dp_rank: int, pp_rank: int, tp_rank: int, gpu_id: Optional[int],
                  launcher: str, ray_accelerator_ids: Optional[Sequence[str]] = None,
                  exec_supported: bool = True) -> ProcessPlacement:
    """Rank TPn on CPU n % 2, memory bound to node 0; exec when the launcher can, else in-process."""
    cpu = tp_rank % 2
    if exec_supported:
        return _hand_placement(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id, strategy="exec",
                               numactl_args=(f"--physcpubind={cpu}", "--membind=0"))
    return _hand_placement(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id, strategy="in-process")


def lying_resolver(server_args: Any, *, dp_rank: int, pp_rank: int, tp_rank: int, gpu_id: Optional[int],
                   launcher: str, ray_accelerator_ids: Optional[Sequence[str]] = None,
                   exec_supported: bool = True) -> ProcessPlacement:
    """Plans CPU tp % 2 but starts numactl on the other CPU: the actor runs where its placement does not say."""
    other = 1 - tp_rank % 2
    return _hand_placement(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id, strategy="exec",
                           numactl_args=(f"--physcpubind={other}", "--membind=0"))


def refused_resolver(server_args: Any, *, dp_rank: int, pp_rank: int, tp_rank: int, gpu_id: Optional[int],
                     launcher: str, ray_accelerator_ids: Optional[Sequence[str]] = None,
                     exec_supported: bool = True) -> ProcessPlacement:
    """An exec placement numactl refuses on this host (memory node 7 does not exist)."""
    return _hand_placement(dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id, strategy="exec",
                           numactl_args=(f"--physcpubind={tp_rank % 2}", "--membind=7"))
