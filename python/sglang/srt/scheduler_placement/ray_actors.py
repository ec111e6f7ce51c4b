"""sglang's Ray scheduler actors, placed: what ``ray/engine.py::_create_scheduler_actor`` delegates to.

The first call for a placement group plans the whole group on its own nodes,
in one round, and keeps the plan under everything it depends on. Each call
then starts its actor under numactl (``runtime_env["py_executable"]``) when
every GPU id Ray may give it there binds alike, else bound in-process once it
knows its id. The failure policy acts here, before the actor exists, when the
rank's placement is already known (a bundle of one GPU); otherwise in the
actor. A plan that cannot be made in time is a warning (each actor then places
its own GPU), or an error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Optional

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from sglang.srt.placement import settings
from sglang.srt.placement.policy import PlacementPolicy, placement_view
from sglang.srt.placement.types import PlacementError, RankIdentity
from sglang.srt.scheduler_placement.ray_plan import (
    GPU,
    ActorStart,
    Candidate,
    plan_on_node_task,
    probe_site_task,
    start_for_rank,
)
from sglang.srt.scheduler_placement.spawn import enforce_failure_policy

logger = logging.getLogger(__name__)

PLAN_TIMEOUT_S = 120.0
"""How long the first actor of a placement group waits for its nodes' plans before going on without."""

_PLANS_KEPT = 8

GroupPlan = Mapping[int, tuple[str, tuple[Candidate, ...]]]
"""bundle index -> (its Ray node, a candidate per GPU id Ray reserved in it)."""


class PlanningError(PlacementError):
    """A placement group's plan could not be made in time; the message names the bundles concerned."""


class Deadline:
    """One deadline for a whole step."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._at - time.monotonic())

    def text(self) -> str:
        return f"{self.timeout_s:g} s"


# --------------------------------------------------------------------------- the planning round


def gather(labels: Mapping[Any, str], *, deadline: Deadline) -> dict[Any, Any]:
    """``ray.get`` every task ref of ``labels`` (ref -> whom it concerns) within
    ``deadline``; at the first failure, or at the deadline, cancel the others (a task
    stuck on its node must not outlive the step) and raise a PlanningError naming
    whom they concern."""
    values: dict[Any, Any] = {}
    try:
        while len(values) < len(labels):
            pending = [ref for ref in labels if ref not in values]
            if not deadline.remaining():
                who = ", ".join(labels[ref] for ref in pending)
                raise PlanningError(
                    f"{who}: placement not planned on its node within {deadline.text()}"
                )
            done, _ = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
            for ref in done:
                try:
                    values[ref] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise PlanningError(
                        f"{labels[ref]}: placement could not be planned on its "
                        f"node: {exc}"
                    ) from exc
    except BaseException:
        for ref in labels:
            if ref not in values:
                try:
                    ray.cancel(ref, force=True)
                except Exception as exc:  # noqa: BLE001 - the error raised matters more
                    logger.warning(
                        f"{labels[ref]}: could not cancel its Ray task: {exc}"
                    )
        raise
    return values


def plan_group(
    pg: Any, server_args: Any, *, policy: PlacementPolicy, deadline: Deadline
) -> GroupPlan:
    """Each GPU bundle's node and candidates, planned on the nodes in one round trip.

    A custom group handed to RayEngine may not be reserved yet: it is waited
    for, within the deadline. A node's probes run one after another (each takes
    the previous one's site), since tiny tasks started together make Ray start
    a worker for each; its plan task takes their sites as arguments, so Ray
    starts it once they are done and the driver waits once, for everything.
    """
    if placement_group_table(pg)["state"] != "CREATED":
        ready, _ = ray.wait([pg.ready()], timeout=deadline.remaining())
        if not ready:
            raise PlanningError(
                f"placement group {pg.id.hex()[:8]}: not reserved within "
                f"{deadline.text()}, so where its bundles are is not known yet"
            )
    table = placement_group_table(pg)["bundles_to_node_id"]
    node_of = {int(index): node for index, node in table.items()}
    specs = pg.bundle_specs
    on_node: dict[str, list[int]] = {}
    for index, spec in enumerate(specs):
        if spec.get(GPU, 0) > 0:
            on_node.setdefault(node_of[index], []).append(index)
    probes: dict[int, Any] = {}
    for members in on_node.values():
        after: list[Any] = []
        for index in members:
            after = [
                probe_site_task.options(
                    num_cpus=0,
                    num_gpus=specs[index][GPU],
                    max_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index
                    ),
                ).remote(index, *after)
            ]
            probes[index] = after[0]
    labels = {probes[index]: f"bundle {index}" for index in sorted(probes)}
    view = placement_view(server_args)
    node_refs = {}
    for node_id, members in on_node.items():
        ref = plan_on_node_task.options(
            num_cpus=0,
            num_gpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            ),
        ).remote(view, policy, *(probes[index] for index in members))
        labels[ref] = f"bundle(s) {', '.join(map(str, members))} on Ray node {node_id}"
        node_refs[ref] = node_id
    plans = gather(labels, deadline=deadline)
    return {
        index: (node_id, candidates)
        for ref, node_id in node_refs.items()
        for index, candidates in plans[ref].items()
    }


# --------------------------------------------------------------------------- plans kept for later calls

_plans: OrderedDict[tuple, Optional[GroupPlan]] = OrderedDict()
_plans_lock = threading.Lock()


def plan_key(placement_group: Any, server_args: Any, policy: PlacementPolicy) -> tuple:
    """Everything a group's plan depends on: the group, the placement fields, the engine's settings."""
    fields = sorted(vars(placement_view(server_args)).items())
    frozen = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in fields)
    return (placement_group.id.hex(), frozen, policy)


def group_plan(
    placement_group: Any,
    server_args: Any,
    *,
    policy: PlacementPolicy,
    deadline: Optional[Deadline] = None,
) -> Optional[GroupPlan]:
    """The group's plan for ``server_args`` under ``policy``: kept from an earlier call, or made now.

    A plan that cannot be made is a warning (None: each actor places itself),
    or an error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
    """
    key = plan_key(placement_group, server_args, policy)
    with _plans_lock:
        if key in _plans:
            _plans.move_to_end(key)
            return _plans[key]
        try:
            found: Optional[GroupPlan] = plan_group(
                placement_group,
                server_args,
                policy=policy,
                deadline=deadline or Deadline(PLAN_TIMEOUT_S),
            )
        except PlanningError as exc:
            message = (
                "scheduler placement could not be planned on the nodes of placement group "
                f"{placement_group.id.hex()[:8]}: {exc}"
            )
            if policy.crash_on_failure:
                raise PlanningError(
                    f"{message} (SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1)"
                ) from exc
            logger.warning(f"{message}; each actor places its own GPU on its node")
            found = None
        _plans[key] = found
        while len(_plans) > _PLANS_KEPT:
            _plans.popitem(last=False)
        return found


def forget_group(placement_group: Any) -> None:
    """Drop the plans kept for ``placement_group`` (it is being removed)."""
    group = placement_group.id.hex()
    with _plans_lock:
        for key in [key for key in _plans if key[0] == group]:
            del _plans[key]


# --------------------------------------------------------------------------- creating the actor

_actor_class: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "sglang_scheduler_actor_class", default=None
)


@contextlib.contextmanager
def scheduler_actor_class(actor_class: Any) -> Iterator[None]:
    """Within the block, ``create_scheduler_actor`` creates ``actor_class`` actors.

    For ``verify``'s probe, which starts through sglang's own
    ``_create_scheduler_actor`` (upstream's arguments) yet reports its binding
    instead of building a ``Scheduler``; a ``contextvars`` value, so that
    nothing outside the calling thread ever sees it.
    """
    token = _actor_class.set(actor_class)
    try:
        yield
    finally:
        _actor_class.reset(token)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine's placement settings set on the driver, which sglang reads inside
    the rank too (bootstrap's CPU thread binding, the legacy bind, the failure
    policy); the host-local SGLANG_SYSFS_ROOT stays each node's own."""
    return {
        name: environ[name] for name in settings.ENGINE_POLICY_VARS if name in environ
    }


def create_scheduler_actor(
    *,
    actor_class: Any,
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
    """Upstream's ``_create_scheduler_actor``, with the actor started under the placement planned on its node.

    ``actor_class`` is the ``SchedulerActor`` that ``ray/engine.py`` imports
    (the glue imports no actor of its own, so the actor may use the glue).
    """
    rank = RankIdentity(
        dp_rank=dp_rank or 0, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id
    )
    exec_string = None
    if not settings.bind_v2():
        # The legacy V1 bind runs inside the actor, in configure_scheduler_process.
        start, how = ActorStart(policy=None), "unplaced (SGLANG_NUMA_BIND_V2=0)"
    else:
        policy = PlacementPolicy.from_env(placement_view(server_args), launcher="ray")
        plans = group_plan(pg, server_args, policy=policy)
        if plans is None or bundle_idx not in plans:
            why = (
                "its placement group could not be planned"
                if plans is None
                else f"bundle {bundle_idx} holds no GPU that was planned"
            )
            start = ActorStart(policy=policy, unplanned=why)
            how = f"placing itself ({why})"
        else:
            node_id, candidates = plans[bundle_idx]
            start, exec_string = start_for_rank(
                candidates, rank=rank, policy=policy, node_id=node_id
            )
            how = (
                "bound in the actor" if exec_string is None else f"under {exec_string}"
            )
        if start.enforced:
            (candidate,) = start.candidates
            if candidate.error is not None:
                raise PlacementError(f"{rank.label}: {candidate.error}")
            enforce_failure_policy(candidate.placement, who=rank.label)
    runtime_env = {"env_vars": forwarded_env(os.environ), "py_executable": exec_string}
    runtime_env = {key: value for key, value in runtime_env.items() if value}
    logger.info(
        f"{rank.label}: scheduler actor in bundle {bundle_idx} of placement group "
        f"{pg.id.hex()[:8]}, {how}"
    )
    return (
        (_actor_class.get() or actor_class)
        .options(
            num_cpus=0,
            num_gpus=1,
            name=(
                f"sglang_scheduler_node{rank0_node_ip}"
                f"_dp{dp_rank}_pp{pp_rank}_tp{tp_rank}"
                f"_pg{pg.id.hex()[:8]}_bundle{bundle_idx}"
            ),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_idx
            ),
            **({"runtime_env": runtime_env} if runtime_env else {}),
        )
        .remote(
            server_args=server_args,
            port_args=port_args,
            gpu_id=gpu_id,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            dist_init_addr=dist_init_addr,
            start=start,
        )
    )


__all__ = ["create_scheduler_actor", "forget_group", "group_plan"]
