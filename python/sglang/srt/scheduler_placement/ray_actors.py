"""sglang's Ray scheduler actors, placed: what ``ray/engine.py::_create_scheduler_actor`` delegates to.

sglang's ``RayEngine`` (and its Ray data-parallel controller) reserve a
placement group and create one ``SchedulerActor`` per rank, one call at a time.
The first call for a placement group plans the whole group in one round, on
the nodes themselves (``plan_group``): where each bundle is, which GPU ids Ray
reserved in it, and each node's placement for every one of those ids. Every
call then starts its actor with its bundle's plan: under numactl through
``runtime_env={"py_executable": ...}`` when every id Ray may give it there binds
alike, else bound in-process once it knows its id.

The failure policy acts here, before the actor exists, when the rank's
placement is already known (a bundle of one GPU): a rank less bound than
intended gets one WARNING naming it, or, under
``SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1``, an error and no actor. Otherwise the
actor applies it to the id it gets, before it builds its ``Scheduler``. A plan
that cannot be made (a node that does not answer in time) is a warning, and
each actor then places its own device on its node, or an error under that
setting.

A plan is kept for later calls under everything it depends on: the group,
the placement fields of the server args and the engine's placement settings.

``verify`` starts its probe ranks through sglang's own
``_create_scheduler_actor``, whose arguments are upstream's; it names the
probe's actor class with ``scheduler_actor_class``, a scope of the calling
thread (a ``contextvars`` value), so nothing else ever sees it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import os
import threading
import time
from typing import Any, Iterator, Mapping, Optional, Sequence

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from sglang.srt.placement import settings
from sglang.srt.placement.plan_args import placement_view
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.types import PlacementError, RankIdentity
from sglang.srt.scheduler_placement.ray_node import (
    GPU,
    plan_on_node_task,
    probe_site_task,
)
from sglang.srt.scheduler_placement.ray_plan import (
    ActorStart,
    BundlePlan,
    NodePlan,
    NodeRequest,
    start_for_rank,
)
from sglang.srt.scheduler_placement.spawn import enforce_failure_policy

logger = logging.getLogger(__name__)

PLAN_TIMEOUT_S = 120.0
"""How long the first actor of a placement group waits for its nodes' plans before going on without."""

_PLANS_KEPT = 8

GroupPlan = Mapping[int, tuple[str, BundlePlan]]
"""bundle index -> (the Ray node it is on, its plan)."""


class PlanningError(RuntimeError):
    """A placement group's plan could not be made in time; the message names the bundles concerned."""


class Deadline:
    """One deadline for a whole step (``timeout_s`` None: wait forever)."""

    def __init__(self, timeout_s: Optional[float]) -> None:
        self.timeout_s = timeout_s
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> Optional[float]:
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def text(self) -> str:
        return "ever" if self.timeout_s is None else f"{self.timeout_s:g} s"


# --------------------------------------------------------------------------- the planning round


def gather(
    labels: Mapping[Any, str], *, deadline: Deadline, late: str, failed: str
) -> dict[Any, Any]:
    """``ray.get`` every task ref of ``labels`` (ref -> whom it concerns) within ``deadline``.

    At the first failure, or at the deadline, the unfinished tasks are
    cancelled (a task stuck on its node must not outlive the step) and a
    PlanningError names whom they concern.
    """
    values: dict[Any, Any] = {}
    try:
        while len(values) < len(labels):
            pending = [ref for ref in labels if ref not in values]
            if deadline.expired():
                who = ", ".join(labels[ref] for ref in pending)
                raise PlanningError(f"{who}: {late} within {deadline.text()}")
            done, _ = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
            for ref in done:
                try:
                    values[ref] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise PlanningError(f"{labels[ref]}: {failed}: {exc}") from exc
    except BaseException:
        for ref in labels:
            if ref not in values:
                try:
                    ray.cancel(ref, force=True)
                except (
                    Exception
                ) as exc:  # noqa: BLE001 - the error being raised matters more
                    logger.warning(
                        f"{labels[ref]}: could not cancel its Ray task: {exc}"
                    )
        raise
    return values


def bundle_nodes(placement_group: Any) -> dict[int, str]:
    """The Ray node each bundle of a reserved placement group is on, from Ray's placement-group table."""
    table = placement_group_table(placement_group)["bundles_to_node_id"]
    return {int(index): node for index, node in table.items()}


def plan_group(
    placement_group: Any,
    server_args: Any,
    *,
    policy: PlacementPolicy,
    deadline: Deadline,
) -> tuple[NodePlan, ...]:
    """Each node's plan for the GPU bundles of a placement group, in one round trip.

    A group the caller created but Ray has not reserved yet (a custom group
    handed to RayEngine) is waited for, within the deadline. One probe per bundle holds all of the bundle's GPUs, to learn their ids;
    a node's probes run one after another (each takes the previous one's site
    as an argument), since tiny tasks started together make Ray start a worker
    for each. One zero-resource task per node then plans that node's bundles;
    Ray starts it once its probes are done (their sites are its arguments), so
    the driver waits once, for everything.
    """
    view = placement_view(server_args)
    specs = placement_group.bundle_specs
    bundles = [index for index, spec in enumerate(specs) if spec.get(GPU, 0) > 0]
    if placement_group_table(placement_group)["state"] != "CREATED":
        ready, _ = ray.wait([placement_group.ready()], timeout=deadline.remaining())
        if not ready:
            raise PlanningError(
                f"placement group {placement_group.id.hex()[:8]}: not reserved within "
                f"{deadline.text()}, so where its bundles are is not known yet"
            )
    node_of = bundle_nodes(placement_group)
    probes: dict[int, Any] = {}
    last_on: dict[str, Any] = {}
    for index in bundles:
        after = last_on.get(node_of[index])
        probes[index] = last_on[node_of[index]] = probe_site_task.options(
            num_cpus=0,
            num_gpus=specs[index][GPU],
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=index
            ),
        ).remote(index, *([] if after is None else [after]))
    labels: dict[Any, str] = {ref: f"bundle {index}" for index, ref in probes.items()}
    node_refs = []
    on_node: dict[str, list[int]] = {}
    for index in bundles:
        on_node.setdefault(node_of[index], []).append(index)
    for node_id, members in on_node.items():
        request = NodeRequest(server_args=view, bundles=tuple(members), policy=policy)
        ref = plan_on_node_task.options(
            num_cpus=0,
            num_gpus=0,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            ),
        ).remote(request, *(probes[index] for index in members))
        labels[ref] = f"bundle(s) {', '.join(map(str, members))} on Ray node {node_id}"
        node_refs.append(ref)
    plans = gather(
        labels,
        deadline=deadline,
        late="placement not planned on its node",
        failed="placement could not be planned on its node",
    )
    return tuple(plans[ref] for ref in node_refs)


def _by_bundle(plans: Sequence[NodePlan]) -> dict[int, tuple[str, BundlePlan]]:
    return {b.bundle_index: (plan.node_id, b) for plan in plans for b in plan.bundles}


# --------------------------------------------------------------------------- plans kept for later calls

_plans: "collections.OrderedDict[tuple, Optional[GroupPlan]]" = (
    collections.OrderedDict()
)
_plans_lock = threading.Lock()


def plan_key(placement_group: Any, server_args: Any, policy: PlacementPolicy) -> tuple:
    """Everything a group's plan depends on: the group, the placement fields, the engine's settings."""
    fields = vars(placement_view(server_args))
    frozen = tuple(
        sorted(
            (name, tuple(value) if isinstance(value, list) else value)
            for name, value in fields.items()
        )
    )
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
            found: Optional[GroupPlan] = _by_bundle(
                plan_group(
                    placement_group,
                    server_args,
                    policy=policy,
                    deadline=deadline or Deadline(PLAN_TIMEOUT_S),
                )
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


def forget_plans() -> None:
    """Drop every kept plan."""
    with _plans_lock:
        _plans.clear()


# --------------------------------------------------------------------------- creating the actor

_actor_class: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "sglang_scheduler_actor_class", default=None
)


@contextlib.contextmanager
def scheduler_actor_class(actor_class: Any) -> Iterator[None]:
    """Within the block (in this thread), ``create_scheduler_actor`` creates ``actor_class`` actors.

    For ``verify``'s probe: a Ray actor class built on ``SchedulerRank`` that
    reports its binding instead of building sglang's ``Scheduler``.
    """
    token = _actor_class.set(actor_class)
    try:
        yield
    finally:
        _actor_class.reset(token)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine's placement settings set on the driver, for the rank's own sglang code to see too.

    sglang reads them inside the rank as well (bootstrap's CPU thread binding,
    the legacy bind, the failure policy); the host-local SGLANG_SYSFS_ROOT stays
    each node's own.
    """
    return {
        name: environ[name] for name in settings.ENGINE_POLICY_VARS if name in environ
    }


def actor_start(
    *, placement_group: Any, bundle_idx: int, rank: RankIdentity, server_args: Any
) -> tuple[ActorStart, Optional[str]]:
    """What ``rank``'s actor in bundle ``bundle_idx`` starts with, and its py_executable.

    Applies the failure policy when the rank's placement is certain here;
    raises the error a setting that does not fit the rank's GPU would raise.
    """
    if not settings.bind_v2():
        # The legacy V1 bind runs inside the actor, in configure_scheduler_process.
        return ActorStart(rank=rank, policy=None), None
    policy = PlacementPolicy.from_env(placement_view(server_args), launcher="ray")
    plans = group_plan(placement_group, server_args, policy=policy)
    if plans is None or bundle_idx not in plans:
        why = (
            "its placement group could not be planned"
            if plans is None
            else f"bundle {bundle_idx} holds no GPU that was planned"
        )
        return ActorStart(rank=rank, policy=policy, unplanned=why), None
    node_id, plan = plans[bundle_idx]
    start, exec_string = start_for_rank(plan, rank=rank, policy=policy, node_id=node_id)
    if start.enforced:
        (candidate,) = start.candidates
        if candidate.error is not None:
            raise PlacementError(f"{rank.label}: {candidate.error}")
        enforce_failure_policy(candidate.placement, who=rank.label)
    return start, exec_string


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
    start, exec_string = actor_start(
        placement_group=pg, bundle_idx=bundle_idx, rank=rank, server_args=server_args
    )
    runtime_env: dict[str, Any] = {}
    env = forwarded_env(os.environ)
    if env:
        runtime_env["env_vars"] = env
    if exec_string is not None:
        runtime_env["py_executable"] = exec_string
    if exec_string is not None:
        how = f"under {exec_string}"
    elif start.candidates:
        how = "bound in the actor"
    elif start.policy is not None:
        how = f"placing itself ({start.unplanned})"
    else:
        how = "unplaced (SGLANG_NUMA_BIND_V2=0)"
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
                placement_group=pg,
                placement_group_bundle_index=bundle_idx,
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


__all__ = ["create_scheduler_actor", "forget_group", "forget_plans", "group_plan"]
