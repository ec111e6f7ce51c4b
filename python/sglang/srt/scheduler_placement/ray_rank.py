"""The bind a Ray scheduler actor runs on itself before its ``Scheduler`` exists (Ray
cannot start an actor under numactl). Its GPU is placed by Ray's id, as NVML (or, on a
bare host, sysfs) numbers it; a container's NVML counts its own GPUs as Ray does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.apply import (
    BindOutcome,
    bind_in_process,
    enforce_failure_policy,
)
from sglang.srt.placement.resolve import place_gpu_id
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import Launcher, ProcessPlacement, RankIdentity

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


def actor_placement(
    server_args: "ServerArgs", *, rank: RankIdentity, assigned_gpus: Sequence[str]
) -> ProcessPlacement:
    """Where the actor of ``rank`` runs on this host; ``rank.gpu_id`` is Ray's id."""
    policy = PlacementPolicy.from_env(server_args, launcher=Launcher.RAY)
    env = settings.device_env()
    if assigned_gpus:  # Ray shows the actor its one GPU as index 0: drop that view
        env = {k: v for k, v in env.items() if k not in settings.VISIBILITY_VARS}
    return place_gpu_id(rank.gpu_id, policy=policy, env=env, rank=rank)


def bind_scheduler_actor(
    server_args: "ServerArgs",
    *,
    gpu_id: int,
    assigned_gpus: Sequence[str],
    tp_rank: int,
    pp_rank: int,
    dp_rank: Optional[int],
) -> Optional[BindOutcome]:
    """None under SGLANG_NUMA_BIND_V2=0, where ``configure_scheduler_process`` binds."""
    if not settings.bind_v2():
        return None
    rank = RankIdentity(dp_rank or 0, pp_rank, tp_rank, gpu_id)
    placement = actor_placement(server_args, rank=rank, assigned_gpus=assigned_gpus)
    enforce_failure_policy(placement, who=rank.label)
    return bind_in_process(placement)
