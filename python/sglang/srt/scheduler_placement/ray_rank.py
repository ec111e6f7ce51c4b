"""The bind a Ray scheduler actor runs on itself, before its ``Scheduler`` exists.

Ray cannot start an actor under numactl, so the actor binds in-process, on its
own host, once it is running: every thread (Ray and torch have started
several by then), the memory policy, and the pages touched so far, which would
otherwise stay on whichever node the worker started on. Ray hands the actor
one GPU under its own ``CUDA_VISIBLE_DEVICES``, where index 0 names whichever
GPU Ray picked; so the GPU is placed by Ray's id, the device as the host
numbers it, through the same ``place_gpu_id`` the spawn path uses.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.apply import BindOutcome, bind_in_process
from sglang.srt.placement.plan import HostFacts, place_gpu_id
from sglang.srt.placement.policy import PlacementPolicy, placement_view
from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.scheduler_placement.spawn import enforce_failure_policy

_RAY_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


def actor_placement(
    server_args: Any, *, rank: RankIdentity, assigned_gpus: Sequence[Any]
) -> ProcessPlacement:
    """Where the actor of ``rank`` runs, on this host; ``rank.gpu_id`` is the id the
    actor uses (``int`` of Ray's first id, else the one passed)."""
    view = placement_view(server_args)
    policy = PlacementPolicy.from_env(view, launcher="ray", exec_supported=False)
    env: Any = os.environ
    if assigned_gpus:
        # Without Ray's one-GPU view, the id names the device it names for Ray.
        env = {k: v for k, v in env.items() if k not in _RAY_VISIBILITY_VARS}
    return place_gpu_id(
        view, rank.gpu_id, policy=policy, facts=HostFacts.live(), env=env, rank=rank
    )


def bind_scheduler_actor(
    server_args: Any,
    *,
    gpu_id: int,
    assigned_gpus: Sequence[Any],
    tp_rank: int,
    pp_rank: int,
    dp_rank: Optional[int],
) -> Optional[tuple[ProcessPlacement, BindOutcome]]:
    """Place and bind the calling actor's process; None under SGLANG_NUMA_BIND_V2=0,
    where ``configure_scheduler_process`` ran the legacy bind.

    A rank less bound than intended gets one warning naming it, or, under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1, a PlacementError before the caller builds
    its ``Scheduler``. The bind logs one line naming the rank and what it bound.
    """
    if not settings.bind_v2():
        return None
    rank = RankIdentity(
        dp_rank=dp_rank or 0, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id
    )
    placement = actor_placement(server_args, rank=rank, assigned_gpus=assigned_gpus)
    enforce_failure_policy(placement, who=rank.label)
    return placement, bind_in_process(placement)
