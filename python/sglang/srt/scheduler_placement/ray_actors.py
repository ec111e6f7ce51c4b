"""Upstream ``RayEngine``'s scheduler actors, placed: what its ``_create_scheduler_actor`` delegates to.

sglang's RayEngine (and its Ray data-parallel controller) reserve their own
placement group and create one ``SchedulerActor`` per rank, one call at a time.
The first call for a placement group plans the whole group, in one round, on
the nodes themselves: where each bundle is, which GPU ids it holds, and each
node's placement for those GPUs (``ray_launcher.plan_actor_starts``). Every
call then starts its actor with its bundle's plan: under numactl through
``runtime_env={"py_executable": ...}`` when every GPU Ray may give it there
binds alike, else bound in-process once it knows its GPU.

A plan that cannot be made is a warning (the actor then resolves its own
placement on its node and binds in-process), or an error under
SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import types
from typing import Any, Optional, Sequence

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sglang.srt.placement import settings
from sglang.srt.placement.plan_args import placement_fields
from sglang.srt.placement.types import RankIdentity
from sglang.srt.ray.scheduler_actor import SchedulerActor
from sglang.srt.scheduler_placement.ray_round import DEFAULT_TIMEOUT_S, Deadline, resolve_on_nodes
from sglang.srt.scheduler_placement.ray_node import Planner
from sglang.srt.scheduler_placement.ray_plan import ActorStart, NodePlan, start_decision

logger = logging.getLogger(__name__)

_PLANS_KEPT = 8
_plans: "collections.OrderedDict[str, dict[int, tuple[ActorStart, Optional[str]]]]" = collections.OrderedDict()
_plans_lock = threading.Lock()


def accelerator_resource(device: str) -> str:
    """The Ray resource one rank of ``device`` holds: "CPU" for the CPU device, else "GPU" (CUDA and XPU)."""
    return "CPU" if device == "cpu" else "GPU"


def rank_resources(device: str) -> dict[str, float]:
    """num_cpus/num_gpus of a rank's actor (its bundle holds exactly this)."""
    if accelerator_resource(device) == "CPU":
        return {"num_cpus": 1, "num_gpus": 0}
    return {"num_cpus": 0, "num_gpus": 1}


def plan_actor_starts(
    placement_group: Any,
    ranks: Sequence[tuple[RankIdentity, int]],
    server_args: Any,
    *,
    deadline: Deadline,
    force_in_process: bool = False,
    planner: Optional[Planner] = None,
    gpus: Optional[Sequence[str]] = None,
    affinity_mode: Optional[str] = None,
    timings: Optional[dict[str, float]] = None,
) -> tuple[list[tuple[int, ActorStart, Optional[str]]], tuple[NodePlan, ...]]:
    """(bundle index, ActorStart, py_executable) per rank of ``ranks`` ((rank, bundle index) pairs), and the
    node plans, from one planning round on an existing placement group.

    A bundle may hold several ranks and several accelerators (upstream's one
    bundle per node): each rank then has every id of its bundle as a candidate.
    """
    from sglang.srt.placement.policy import PlacementPolicy

    timings = {} if timings is None else timings
    resource = accelerator_resource(server_args.device)
    policy = PlacementPolicy.from_env(server_args, launcher="ray", affinity_mode=affinity_mode,
                                      exec_supported=not force_in_process)
    started = time.perf_counter()
    plans = resolve_on_nodes(ranks, server_args, placement_group=placement_group, resource=resource,
                             policy=policy, deadline=deadline, gpus=gpus, planner=planner)
    timings["plan_s"] = time.perf_counter() - started
    timings["node_resolve_s"] = max(p.resolve_s for p in plans)

    by_rank = {(rp.rank, rp.bundle_index): (plan.node_id, rp) for plan in plans for rp in plan.ranks}
    out = []
    for rank, index in ranks:
        node_id, rank_plan = by_rank[(rank, index)]
        start, exec_string = start_decision(rank_plan, accelerator_resource=resource, node_id=node_id,
                                            force_in_process=force_in_process, log=logger.warning)
        out.append((index, start, exec_string))
    return out, plans


def _plan_group(pg: Any, server_args: Any) -> dict[int, tuple[ActorStart, Optional[str]]]:
    """Each GPU bundle's start (one placement per GPU id it holds) and py_executable, planned on its node."""
    bundles = [index for index, spec in enumerate(pg.bundle_specs) if spec.get("GPU", 0) > 0]
    # One stand-in rank per bundle: every rank started in a bundle may get any of its GPUs.
    ranks = [(RankIdentity(dp_rank=0, pp_rank=0, tp_rank=index, gpu_id=0, global_rank=index), index)
             for index in bundles]
    # The fields placement reads, as a light value that a node's task unpickles without importing ServerArgs.
    fields = types.SimpleNamespace(**placement_fields(server_args))
    starts, _ = plan_actor_starts(pg, ranks, fields, deadline=Deadline(DEFAULT_TIMEOUT_S))
    return {index: (start, exec_string) for index, start, exec_string in starts}


def _group_plan(pg: Any, server_args: Any) -> Optional[dict[int, tuple[ActorStart, Optional[str]]]]:
    key = pg.id.hex()
    with _plans_lock:
        if key in _plans:
            _plans.move_to_end(key)
            return _plans[key]
        try:
            plan = _plan_group(pg, server_args)
        except Exception as exc:  # noqa: BLE001 - any planning failure has one policy
            message = f"scheduler placement could not be planned on the nodes of placement group {key[:12]}: {exc}"
            if settings.bind_failure_is_fatal():
                raise RuntimeError(f"{message} (SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1)") from exc
            logger.warning(f"{message}; each actor resolves its own placement and binds in-process")
            plan = None
        _plans[key] = plan
        while len(_plans) > _PLANS_KEPT:
            _plans.popitem(last=False)
        return plan


def _start_of(template: ActorStart, rank: RankIdentity) -> ActorStart:
    """The bundle's planned start, told which rank it is for."""
    candidates = tuple(
        (accelerator_id, placement.replace(dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank,
                                           gpu_id=rank.gpu_id))
        for accelerator_id, placement in template.candidates
    )
    return ActorStart(rank=rank, accelerator_resource=template.accelerator_resource, node_id=template.node_id,
                      candidates=candidates)


def create_scheduler_actor(
    *,
    pg: Any,
    bundle_idx: int,
    gpu_id: int,
    server_args: Any,
    port_args: Any,
    tp_rank: int,
    pp_rank: int,
    dp_rank: int,
    dist_init_addr: str,
    rank0_node_ip: str,
) -> Any:
    """Upstream's ``_create_scheduler_actor``, with the actor started under the placement planned on its node."""
    rank = RankIdentity(dp_rank=dp_rank or 0, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id)
    start: Optional[ActorStart] = None
    exec_string: Optional[str] = None
    if settings.bind_v2() and getattr(server_args, "device", None) != "cpu":
        plan = _group_plan(pg, server_args)
        if plan is not None and bundle_idx in plan:
            template, exec_string = plan[bundle_idx]
            start = _start_of(template, rank)
    options: dict[str, Any] = {}
    if exec_string is not None:
        options["runtime_env"] = {"py_executable": exec_string}
    how = f"under {exec_string}" if exec_string else ("bound in the actor" if start is not None else "unplanned")
    logger.info(f"{rank.label}: scheduler actor in bundle {bundle_idx} of placement group {pg.id.hex()[:8]}, {how}")
    return SchedulerActor.options(
        num_cpus=0,
        num_gpus=1,
        name=(
            f"sglang_scheduler_node{rank0_node_ip}"
            f"_dp{dp_rank}_pp{pp_rank}_tp{tp_rank}"
            f"_pg{pg.id.hex()[:8]}_bundle{bundle_idx}"
        ),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=bundle_idx,
        ),
        **options,
    ).remote(
        server_args=server_args,
        port_args=port_args,
        gpu_id=gpu_id,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        dist_init_addr=dist_init_addr,
        start=start,
    )


def forget_plans() -> None:
    """Drop every cached placement-group plan (a group's plan is kept for its later calls)."""
    with _plans_lock:
        _plans.clear()


__all__ = ["create_scheduler_actor", "forget_plans"]

