"""The Ray launcher: a bundle per rank, each node's ranks planned together there, a ``SchedulerActor`` per bundle.

A placed launch is three steps, all bounded by one deadline: reserve the
placement group; one planning round (``resolve_on_nodes``: a task per bundle,
holding its accelerator, learns the id Ray assigns there, and a task per node,
started by Ray as soon as those are done, plans all of that node's ranks with
the whole node in view); then each actor is created in its bundle, under
numactl through ``runtime_env={"py_executable": ...}`` when its plan says exec,
so the binding holds before the interpreter allocates anything.
``placement=False`` skips the planning round and starts unbound actors. On any
failure nothing is left behind: actors are killed and the placement group is
removed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sglang.srt.placement import settings
from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.ray.scheduler_actor import SchedulerActor, Target
from sglang.srt.scheduler_rank.common import DEFAULT_TIMEOUT_S, Deadline, RankLaunchError, RankResult
from sglang.srt.scheduler_rank.ray_node import Planner
from sglang.srt.scheduler_rank.ray_plan import ActorStart, NodePlan, start_decision, unplaced_start
from sglang.srt.scheduler_launch.ray_sites import gather, resolve_on_nodes

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 15.0
ACTOR_NAME_PREFIX = "sglang_scheduler"


# --------------------------------------------------------------------------- pure decisions


def accelerator_resource(device: str) -> str:
    """The Ray resource one rank of ``device`` holds: "CPU" for the CPU device, else "GPU" (CUDA and XPU)."""
    return "CPU" if device == "cpu" else "GPU"


def rank_resources(device: str) -> dict[str, float]:
    """num_cpus/num_gpus of a rank's actor (its bundle holds exactly this)."""
    if accelerator_resource(device) == "CPU":
        return {"num_cpus": 1, "num_gpus": 0}
    return {"num_cpus": 0, "num_gpus": 1}


def rank_bundle(device: str) -> dict[str, float]:
    return {accelerator_resource(device): 1.0}


def forwarded_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The engine-policy settings set on the driver, passed to every actor.

    Ray workers inherit the raylet's environment, not the driver's; the settings
    the user gave the engine must reach each rank. Host-local settings
    (SGLANG_SYSFS_ROOT: a path on the driver's host) are never passed on: each
    node's own environment decides them.
    """
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in settings.ENGINE_POLICY_VARS if name in environ}


def engine_ranks(server_args: Any) -> tuple[RankIdentity, ...]:
    """Every rank of the engine, all node ranks, in launch order; which Ray node runs it is the group's choice."""
    import dataclasses

    from sglang.srt.placement.resolve import local_ranks

    return tuple(
        rank
        for node_rank in range(server_args.nnodes)
        for rank in local_ranks(dataclasses.replace(server_args, node_rank=node_rank))
    )


def actor_name(rank: RankIdentity, *, group_hex: str) -> str:
    return f"{ACTOR_NAME_PREFIX}_{group_hex[:12]}_dp{rank.dp_rank}_pp{rank.pp_rank}_tp{rank.tp_rank}"


# --------------------------------------------------------------------------- the launch


@dataclass
class LaunchedActor:
    """One rank's actor and what the driver knows of it (its placement is the actor's own once it is ready)."""

    rank: RankIdentity
    start: ActorStart
    name: str
    actor: Any
    py_executable: Optional[str]
    placement: Optional[ProcessPlacement] = None
    info: Optional[dict] = None
    binding: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.rank.label

    @property
    def node_id(self) -> Optional[str]:
        return self.start.node_id


@dataclass
class RayLaunch:
    """The placement group and the actors of one launch, each node's plan, and where the time went."""

    placement_group: Any
    actors: list[LaunchedActor] = field(default_factory=list)
    plans: tuple[NodePlan, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    closed: bool = False


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError(
            "the Ray launcher needs a Ray cluster: call ray.init() (or ray.init(address=...)) before launching"
        )


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
    from sglang.srt.placement.resolve import PlacementPolicy

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


def start_actors(
    placement_group: Any,
    starts: Sequence[tuple[int, ActorStart, Optional[str]]],
    server_args: Any,
    *,
    target: Target,
    env: Optional[Mapping[str, str]] = None,
) -> list[LaunchedActor]:
    """Create one SchedulerActor per (bundle index, ActorStart, py_executable), each in its bundle; returns at once."""
    env = forwarded_env() if env is None else dict(env)
    resources = rank_resources(server_args.device)
    group_hex = placement_group.id.hex()
    launched = []
    for index, start, exec_string in starts:
        runtime_env: dict[str, Any] = {}
        if env:
            runtime_env["env_vars"] = dict(env)
        if exec_string is not None:
            runtime_env["py_executable"] = exec_string
        name = actor_name(start.rank, group_hex=group_hex)
        actor = SchedulerActor.options(
            name=name,
            **resources,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=index
            ),
            runtime_env=runtime_env or None,
        ).remote(server_args, None, start.rank.gpu_id or 0, start.rank.tp_rank, start.rank.pp_rank, start.rank.dp_rank,
                  start=start, target=target)
        placement = start.candidates[0][1] if start.placed else None
        launched.append(LaunchedActor(rank=start.rank, start=start, name=name, actor=actor,
                                      py_executable=exec_string, placement=placement))
        how = f"under {exec_string}" if exec_string else (
            f"strategy {placement.strategy}" if placement is not None else "unplaced")
        where = f" on node {start.node_id[:12]}" if start.node_id else ""
        logger.info(f"{start.rank.label}: scheduler actor {name} created{where} {how}")
    return launched


def launch_scheduler_actors(
    server_args: Any,
    *,
    target: Target,
    timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
    force_in_process: bool = False,
    placement: bool = True,
    planner: Optional[Planner] = None,
    gpus: Optional[Sequence[str]] = None,
    affinity_mode: Optional[str] = None,
) -> RayLaunch:
    """Reserve one bundle per rank, plan each node's ranks on that node, and create each rank's actor in its bundle.

    ``force_in_process`` makes every bound rank bind in-process (libnuma) rather
    than start under numactl; ``placement=False`` skips planning and starts
    unbound actors. ``planner`` replaces ``plan_node`` on the nodes (tests);
    ``gpus`` and ``affinity_mode`` are ``plan_node``'s. On any failure nothing
    is left behind.
    """
    _require_ray()
    deadline = Deadline(timeout_s)
    ranks = engine_ranks(server_args)
    bundle = rank_bundle(server_args.device)
    strategy = "STRICT_PACK" if server_args.nnodes == 1 else "PACK"

    started = time.perf_counter()
    group = placement_group([dict(bundle) for _ in ranks], strategy=strategy)
    launch = RayLaunch(placement_group=group)
    try:
        ready, _ = ray.wait([group.ready()], timeout=deadline.remaining())
        if not ready:
            raise RankLaunchError(
                f"the Ray placement group for {len(ranks)} rank(s) ({len(ranks)} x {bundle}, {strategy}) was not "
                f"reserved within {deadline.text()}; free cluster resources: {ray.available_resources()}. "
                f"Free or add resources, or lower --tp-size/--pp-size/--dp-size."
            )
        launch.timings["placement_group_s"] = time.perf_counter() - started

        pairs = [(rank, index) for index, rank in enumerate(ranks)]
        if placement:
            starts, launch.plans = plan_actor_starts(
                group, pairs, server_args, deadline=deadline, force_in_process=force_in_process, planner=planner,
                gpus=gpus, affinity_mode=affinity_mode, timings=launch.timings,
            )
        else:
            resource = accelerator_resource(server_args.device)
            starts = [(index, unplaced_start(rank, accelerator_resource=resource), None) for rank, index in pairs]

        started = time.perf_counter()
        launch.actors = start_actors(group, starts, server_args, target=target)
        launch.timings["create_s"] = time.perf_counter() - started
    except BaseException:
        shutdown_ray(launch)
        raise
    return launch


def _call_all(launch: RayLaunch, *, call: Callable[[LaunchedActor], Any], timeout_s: Optional[float],
              **messages: str) -> dict[str, Any]:
    """Call a remote method on every actor; its result per actor name. On the first failure or the deadline,
    shut all down and raise naming the rank."""
    try:
        refs = {call(a): a for a in launch.actors}
        got = gather({ref: a.label for ref, a in refs.items()}, deadline=Deadline(timeout_s), cancel=False,
                     **messages)
        return {refs[ref].name: value for ref, value in got.items()}
    except BaseException:
        shutdown_ray(launch)
        raise


def wait_ready_ray(launch: RayLaunch, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Wait until every actor reports readiness; on the first failure or the deadline, shut all down and raise.

    Each result's placement is the one the actor applied (for a rank with
    several candidate ids, the one of the id Ray gave it). A rank whose binding
    differs from its placement is logged as a warning here (the actor refused
    to start instead under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1).
    """
    fix = ""
    if any(a.py_executable for a in launch.actors):
        fix = ("A worker that numactl or the interpreter refused to start never registers with Ray: "
               "see the raylet log (raylet.out) on the rank's node.")
    started = time.perf_counter()
    reports = _call_all(launch, call=lambda a: a.actor.ready.remote(), timeout_s=timeout_s,
                        late="scheduler actor not ready", failed="scheduler actor died before it was ready", fix=fix)
    try:
        for a in launch.actors:
            _take_report(a, reports[a.name])
    except BaseException:
        shutdown_ray(launch)
        raise
    launch.timings["ready_s"] = time.perf_counter() - started
    return [RankResult(placement=a.placement, rank=a.rank, info=a.info or {}) for a in launch.actors]


def _take_report(a: LaunchedActor, report: dict) -> None:
    a.binding = report.get("binding") or {}
    if report.get("placement") is not None:
        a.placement = report["placement"]
    if report["status"] != "ready":
        raise RankLaunchError(
            f"{a.label}: scheduler actor failed to initialise: {report['error']}\n{report['traceback']}",
            label=a.label, error=report["error"], child_traceback=report["traceback"],
        )
    a.info = report["info"]
    pid = a.binding.get("pid")
    mismatches = a.binding.get("mismatches") or []
    if mismatches:
        logger.warning(
            f"{a.label}: scheduler actor {a.name} (pid {pid}) is not where its placement says "
            f"(strategy {a.placement.strategy}): {'; '.join(mismatches)}"
        )
    elif a.placement is not None:
        from sglang.srt.placement.resolve import describe

        logger.info(f"{a.label}: scheduler actor ready (pid {pid}): {describe(a.placement)}")


def wait_finished_ray(launch: RayLaunch, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
    """Run every actor's event loop until it returns; on failure or the deadline, shut all down and raise."""
    _call_all(launch, call=lambda a: a.actor.run_event_loop.remote(), timeout_s=timeout_s,
              late="scheduler event loop still running", failed="scheduler event loop failed")


def shutdown_ray(launch: RayLaunch, *, wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Kill every actor of the launch, remove its placement group, and wait until the actors are gone."""
    if launch.closed:
        return
    launch.closed = True
    for a in launch.actors:
        try:
            ray.kill(a.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - keep going: the group removal below kills it too
            logger.warning(f"{a.label}: could not kill scheduler actor {a.name}: {exc}")
    try:
        remove_placement_group(launch.placement_group)
    except Exception as exc:  # noqa: BLE001
        logger.warning(f"could not remove the Ray placement group {launch.placement_group.id.hex()}: {exc}")
    names = {a.name for a in launch.actors}
    deadline = time.monotonic() + wait_s
    while names:
        names &= set(ray.util.list_named_actors())
        if not names or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if names:
        logger.warning(f"scheduler actors still listed by Ray {wait_s:.0f} s after they were killed: {sorted(names)}")


def run_ranks_ray(
    server_args: Any,
    *,
    target: Target,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **launch_options: Any,
) -> list[RankResult]:
    """Start every rank of the engine as a Ray actor, wait for readiness, run the event loops out, shut down.

    ``launch_options`` are ``launch_scheduler_actors``'s. Each RankResult carries
    the placement the actor applied, resolved on its node (not the driver's).
    Raises :class:`RankLaunchError` naming the failed rank with its error and
    traceback, and leaves no actor or placement group behind.
    """
    launch = launch_scheduler_actors(server_args, target=target, timeout_s=timeout_s, **launch_options)
    try:
        results = wait_ready_ray(launch, timeout_s=timeout_s)
        wait_finished_ray(launch, timeout_s=timeout_s)
        return results
    finally:
        shutdown_ray(launch)
