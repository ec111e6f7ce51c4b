"""A scheduler rank's own placement steps inside its Ray actor: the body every scheduler actor is built on.

``SchedulerRank`` takes upstream ``SchedulerActor``'s arguments
(``server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank,
dist_init_addr=None``) plus the ``start`` that sglang's
``_create_scheduler_actor`` planned on the actor's node (an ``ActorStart``:
one placement per GPU id Ray may give the actor). ``_place`` takes the
placement of the id Ray gave it (or, without one, places that GPU itself, by
Ray's own id, on its node), applies the failure policy and the in-process
part of the binding, and reads the binding back. A subclass brings the rank up
in ``_start_scheduler``, calling ``_place`` before it allocates anything:
``ray/scheduler_actor.py``'s ``SchedulerActor`` builds sglang's ``Scheduler``,
``verify``'s probe only reports what its process observes.

This module imports nothing of sglang's engine, so an actor built on it
alone (the probe) starts without loading the model stack.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

import ray

from sglang.srt.placement import settings
from sglang.srt.placement.plan import plan_node
from sglang.srt.placement.plan_args import placement_view
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity
from sglang.srt.scheduler_placement.in_rank import (
    apply_in_rank,
    read_back,
    report_mismatches,
)
from sglang.srt.scheduler_placement.ray_node import accelerator_ids_here
from sglang.srt.scheduler_placement.ray_plan import actor_choice
from sglang.srt.scheduler_placement.spawn import enforce_failure_policy

if TYPE_CHECKING:
    from sglang.srt.scheduler_placement.ray_plan import ActorStart

logger = logging.getLogger(__name__)


def own_placement(
    server_args: Any,
    *,
    rank: RankIdentity,
    accelerator_id: Optional[str],
    policy: Optional[PlacementPolicy],
    why: str,
) -> Optional[ProcessPlacement]:
    """The placement of an actor without a plan for the GPU it got: that GPU, by Ray's id, on this node.

    Only the device Ray gave the actor is identified (never under this
    process's one-GPU ``CUDA_VISIBLE_DEVICES``, never the engine's other
    ranks); one that cannot be identified leaves the rank unbound with the
    reason. The process is running, so the binding is in-process. ``policy``
    is the engine's, from the driver; None (an older caller) reads this
    process's settings, and gives None when they turn placement off.
    """
    view = placement_view(server_args)
    if policy is None:
        if not settings.bind_v2():
            return None
        policy = PlacementPolicy.from_env(view, launcher="ray")
    policy = dataclasses.replace(policy, exec_supported=False)
    (placement,) = plan_node(
        view, ranks_with_ids=[(rank, accelerator_id)], policy=policy
    )
    reasons = [f"{why}: the actor placed the GPU Ray gave it", *placement.reasons]
    warning = placement.warning
    if policy.affinity_mode == "exclusive" and placement.bound:
        reasons.append(
            "exclusive mode needs the other ranks of the node, which this actor does not "
            "know: bound to the whole node"
        )
        warning = True
    return placement.replace(reasons=tuple(reasons), warning=warning)


class SchedulerRank:
    """One scheduler rank in its own Ray worker process: upstream's arguments, the plan, the placement steps."""

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
        start: Optional["ActorStart"] = None,
    ) -> None:
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._placement: Optional[ProcessPlacement] = None
        self._binding: Dict[str, Any] = {}
        self._start = start
        # Get actual GPU IDs from Ray runtime context (upstream's SchedulerActor, as it was)
        assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
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
        """Bring the rank up on ``gpu_id`` (the id it uses), calling ``_place`` before it allocates."""
        raise NotImplementedError

    def _place(self, server_args: Any) -> None:
        """Take this rank's placement, apply the failure policy and its in-rank part, read the binding back."""
        start, who = self._start, self._rank.label
        if start is not None and start.policy is None:
            return  # placement is off: the legacy bind ran in configure_scheduler_process
        ids = accelerator_ids_here()
        node_id = ray.get_runtime_context().get_node_id()
        candidate, why = (
            actor_choice(start, ids, node_id=node_id)
            if start is not None
            else (None, "the actor was created without a plan from its node")
        )
        enforced = False
        if candidate is None:
            placement = own_placement(
                server_args,
                rank=self._rank,
                accelerator_id=ids[0] if ids else None,
                policy=start.policy if start is not None else None,
                why=why,
            )
            if placement is None:
                return
        elif candidate.error is not None:
            raise PlacementError(f"{who}: {candidate.error}")
        else:
            placement, enforced = candidate.placement, start.enforced
        self._placement = placement
        if not enforced:
            enforce_failure_policy(placement, who=who)
        outcome = apply_in_rank(placement, who=who)
        self._binding = {
            "node_id": node_id,
            "accelerator_ids": list(ids),
            "planned_on": (
                start.node_id if start is not None and candidate is not None else None
            ),
            **read_back(placement),
        }
        if (
            outcome is None or not outcome.degraded
        ):  # a degraded bind has warned already
            report_mismatches(placement, self._binding, who=who, warn=logger.warning)

    def binding_report(self) -> Dict[str, Any]:
        """What the rank read back after applying its placement (pid, observed binding, mismatches)."""
        placement = self._placement.to_dict() if self._placement is not None else None
        return {**self._binding, "placement": placement}
