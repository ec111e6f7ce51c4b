"""A scheduler rank's own placement steps inside its Ray actor: the body every
scheduler actor is built on.

``SchedulerRank`` takes upstream ``SchedulerActor``'s arguments plus the
``start`` (``ray_plan.ActorStart``) that ``_create_scheduler_actor`` planned on
the actor's node. ``_place`` takes the placement of the GPU id Ray gave it (or,
without one, places that GPU itself, on its node), applies the failure policy
and the in-process part of the binding, and reads the binding back. A subclass
brings the rank up in ``_start_scheduler``, calling ``_place`` before it
allocates anything: ``ray/scheduler_actor.py``'s ``SchedulerActor`` builds
sglang's ``Scheduler``. This module imports nothing of sglang's engine, so an
actor built on it alone (verify's probe) starts without the model stack.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Dict, Optional

import ray

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.plan import plan_node
from sglang.srt.placement.policy import PlacementPolicy, placement_view
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import (
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
    TopologyError,
)
from sglang.srt.scheduler_placement.ray_plan import (
    ActorStart,
    accelerator_ids_here,
    actor_choice,
)
from sglang.srt.scheduler_placement.spawn import enforce_failure_policy

logger = logging.getLogger(__name__)


def own_placement(
    server_args: Any,
    *,
    rank: RankIdentity,
    accelerator_id: Optional[str],
    policy: PlacementPolicy,
    why: str,
) -> ProcessPlacement:
    """The placement of an actor without a plan for the GPU it got: that GPU, by Ray's
    id, on this node (never under this process's one-GPU ``CUDA_VISIBLE_DEVICES``),
    bound in-process.
    """
    policy = dataclasses.replace(policy, exec_supported=False)
    (placement,) = plan_node(
        placement_view(server_args),
        ranks_with_ids=[(rank, accelerator_id)],
        policy=policy,
    )
    reasons = [f"{why}: the actor placed the GPU Ray gave it", *placement.reasons]
    return placement.replace(reasons=tuple(reasons))


def thread_mismatches(
    placement: ProcessPlacement, *, tasks_dir: str = "/proc/self/task"
) -> list[str]:
    """One line when some thread of this process may run outside the CPUs of an exec
    or in-process ``placement`` (``/proc/self/status`` shows the main thread only, and
    a process bound from one thread keeps its other threads, and their allocations,
    unbound)."""
    if (
        placement.strategy not in (Strategy.EXEC, Strategy.IN_PROCESS)
        or not placement.cpus
    ):
        return []
    threads: dict[int, frozenset[int]] = {}
    for name in filter(str.isdigit, os.listdir(tasks_dir)):
        try:
            status = os.path.join(tasks_dir, name, "status")
            threads[int(name)] = read_process_affinity(status).cpus
        except TopologyError:
            continue  # the thread exited after the listing
    off = {tid: cpus for tid, cpus in threads.items() if cpus != placement.cpus}
    if not off:
        return []
    tid, cpus = sorted(off.items())[0]
    return [
        f"{len(off)} of {len(threads)} threads may run outside the planned CPUs "
        f"(thread {tid}: cpus {format_cpulist(cpus) or '(none)'}, "
        f"planned {format_cpulist(placement.cpus)})"
    ]


class SchedulerRank:
    """One scheduler rank in its own Ray worker process: upstream's arguments, the
    plan, the placement steps."""

    def __init__(
        self,
        server_args: Any,
        port_args: Any,
        gpu_id: int,
        tp_rank: int,
        pp_rank: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str] = None,
        *,
        start: Optional[ActorStart] = None,
    ) -> None:
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._placement: Optional[ProcessPlacement] = None
        self._binding: Dict[str, Any] = {}
        self._start = start
        # The GPU Ray assigned, else the one passed (upstream's SchedulerActor does so)
        assigned = accelerator_ids_here()
        if assigned:
            # Ray assigned specific GPU(s), use the first one
            actual_gpu_id = int(assigned[0])
            logger.info(f"[TP{tp_rank}] Ray assigned GPU: {actual_gpu_id}")
        else:
            # Fallback to passed gpu_id
            actual_gpu_id = gpu_id
            logger.info(f"[TP{tp_rank}] Using passed gpu_id: {gpu_id}")
        self._rank = RankIdentity(
            dp_rank=dp_rank or 0, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=actual_gpu_id
        )
        self._start_scheduler(
            server_args,
            port_args,
            gpu_id=actual_gpu_id,
            dp_rank=dp_rank,
            dist_init_addr=dist_init_addr,
        )

    def _start_scheduler(
        self,
        server_args: Any,
        port_args: Any,
        *,
        gpu_id: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str],
    ) -> None:
        """Bring the rank up on ``gpu_id`` (the id it uses), calling ``_place``
        before it allocates; here a rank without a model (verify's probe) is only
        placed."""
        self._place(server_args)

    def _place(self, server_args: Any) -> None:
        """Take this rank's placement, apply the failure policy and its in-rank part,
        read the binding back."""
        from sglang.srt.placement.apply import bind_in_process
        from sglang.srt.placement_tools.observe import compare_binding, observe_self

        start, who = self._start, self._rank.label
        if start is None and settings.bind_v2():
            # An older caller: no plan, and the settings are this process's.
            view = placement_view(server_args)
            why = "the actor was created without a plan from its node"
            start = ActorStart(
                PlacementPolicy.from_env(view, launcher="ray"), unplanned=why
            )
        if start is None or start.policy is None:
            return  # placement is off: configure_scheduler_process ran the legacy bind
        ids = accelerator_ids_here()
        node_id = ray.get_runtime_context().get_node_id()
        candidate, why = actor_choice(start, ids, node_id=node_id)
        if candidate is None:
            placement = own_placement(
                server_args,
                rank=self._rank,
                accelerator_id=ids[0] if ids else None,
                policy=start.policy,
                why=why,
            )
        elif candidate.error is not None:
            raise PlacementError(f"{who}: {candidate.error}")
        else:
            placement = candidate.placement
        self._placement = placement
        if candidate is None or not start.enforced:
            enforce_failure_policy(placement, who=who)
        summary = (
            f"node={placement.numa_node} cpus={format_cpulist(placement.cpus) or '-'} "
            f"mem={placement.mem_policy}:{format_cpulist(placement.mem_nodes) or '-'} "
            f"strategy={placement.strategy}"
        )
        degraded = False  # a degraded in-process bind has warned already
        if placement.strategy == Strategy.IN_PROCESS:
            degraded = bind_in_process(placement).degraded
            logger.info(f"{who}: bound in-process: {summary}")
        elif placement.strategy == Strategy.EXEC:
            args = " ".join(placement.numactl_args)
            logger.info(f"{who}: started under numactl {args}: {summary}")
        else:
            why = "; ".join(placement.reasons) or "no reason recorded"
            logger.info(f"{who}: not bound ({why})")
        observed = observe_self()
        mismatches = [
            *compare_binding(placement, observed),
            *thread_mismatches(placement),
        ]
        self._binding = {
            "node_id": node_id,
            "accelerator_ids": list(ids),
            "planned_on": start.node_id if candidate is not None else None,
            "pid": os.getpid(),
            "observed": observed.to_dict(),
            "threads": len(os.listdir("/proc/self/task")),
            "mismatches": mismatches,
        }
        if mismatches and not degraded:
            message = (
                f"{who}: scheduler (pid {os.getpid()}) is not where its placement says "
                f"(strategy {placement.strategy}): {'; '.join(mismatches)}"
            )
            if settings.bind_failure_is_fatal():
                raise PlacementError(
                    f"{message}. SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal; "
                    "fix the cause, or unset it to run with a warning."
                )
            logger.warning(message)

    def binding_report(self) -> Dict[str, Any]:
        """What the rank read back after applying its placement (pid, observed
        binding, mismatches)."""
        placement = self._placement and self._placement.to_dict()
        return {**self._binding, "placement": placement}
