"""The Ray launcher: one ``SchedulerActor`` per rank, each in its own placement-group bundle.

Per rank, in that rank's bundle and with the actor's resources (so Ray hands it
the same node and accelerator), a small task resolves the placement where the
rank will run. The actor is then created in the same bundle; an ``exec``
placement starts its worker under numactl through
``runtime_env={"py_executable": ...}``, so the binding holds before the
interpreter allocates anything, and the worker keeps its pid.

Ray 2.60 does not exec ``py_executable`` as an argv: the worker is started by
``bash -c "exec <py_executable> <quoted worker args>"`` (``RuntimeEnvContext.exec_worker``),
so the string is split and expanded by a shell. Every token is therefore
checked against a strict pattern (an absolute path, or a numactl option whose
value is digits, commas and dashes) before it is joined; a token that fails
(say, a Python path with a space) makes the rank bind in-process instead, with
the reason in its placement.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sglang.srt.placement import settings
from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy
from sglang.srt.ray.scheduler_actor import SchedulerActor, Target
from sglang.srt.scheduler_launch.common import (
    DEFAULT_TIMEOUT_S,
    ExecCommand,
    RankLaunchError,
    RankResult,
    decide_start,
)
from sglang.srt.scheduler_launch.ray_node import resolve_on_node_task

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 15.0
ACTOR_NAME_PREFIX = "sglang_scheduler"

_NUMACTL_OPTION = re.compile(r"--[a-z][a-z-]*(=[0-9][0-9,-]*)?")
_ABSOLUTE_PATH = re.compile(r"/[A-Za-z0-9_.+@/-]*")


# --------------------------------------------------------------------------- pure decisions


def exec_argv_problem(argv: Sequence[str]) -> Optional[str]:
    """Why ``argv`` ([numactl, *options, python]) cannot be handed to Ray's shell safely; None when it can."""
    if len(argv) < 2:
        return f"the exec command {list(argv)!r} needs at least numactl and a Python interpreter"
    numactl, *options, python = argv
    for what, path in (("numactl path", numactl), ("Python interpreter path", python)):
        if not _ABSOLUTE_PATH.fullmatch(path):
            return (
                f"the {what} {path!r} is not an absolute path of letters, digits and _.+@/- only "
                f"(Ray runs py_executable through a shell)"
            )
    for option in options:
        if not _NUMACTL_OPTION.fullmatch(option):
            return f"the numactl option {option!r} is not of the form --name=digits,commas,dashes"
    return None


def py_executable(argv: Sequence[str]) -> str:
    """The ``runtime_env["py_executable"]`` string for ``argv``; raises ValueError when it is not safe."""
    problem = exec_argv_problem(argv)
    if problem is not None:
        raise ValueError(problem)
    # Quoting is a no-op for tokens that passed the check; it stays as a second guard.
    return " ".join(shlex.quote(token) for token in argv)


def accelerator_resource(device: str) -> str:
    """The Ray resource one rank of ``device`` holds: "CPU" for the CPU device, else "GPU" (CUDA and XPU)."""
    return "CPU" if device == "cpu" else "GPU"


def rank_resources(device: str) -> dict[str, float]:
    """num_cpus/num_gpus of a rank's bundle, its resolve task and its actor."""
    if accelerator_resource(device) == "CPU":
        return {"num_cpus": 1, "num_gpus": 0}
    return {"num_cpus": 0, "num_gpus": 1}


def rank_bundle(device: str) -> dict[str, float]:
    return {accelerator_resource(device): 1.0}


def forwarded_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The placement settings (``Envs`` fields) set on the driver, passed to every rank's task and actor.

    Ray workers inherit the raylet's environment, not the driver's; the settings
    the user gave the engine must reach the node that resolves and runs a rank.
    """
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in settings.ENGINE_POLICY_VARS if name in environ}


def engine_ranks(server_args: Any) -> list[tuple[Any, RankIdentity]]:
    """Every rank of the engine with the server args of its node (node_rank set), in launch order."""
    from sglang.srt.placement.resolve import local_ranks

    out: list[tuple[Any, RankIdentity]] = []
    for node_rank in range(server_args.nnodes):
        node_args = (
            server_args if node_rank == server_args.node_rank else dataclasses.replace(server_args, node_rank=node_rank)
        )
        out.extend((node_args, rank) for rank in local_ranks(node_args))
    return out


def actor_name(rank: RankIdentity, *, group_hex: str) -> str:
    return f"{ACTOR_NAME_PREFIX}_{group_hex[:12]}_dp{rank.dp_rank}_pp{rank.pp_rank}_tp{rank.tp_rank}"


def start_decision(
    *, rank: RankIdentity, resolved: Mapping[str, Any], force_in_process: bool
) -> tuple[ProcessPlacement, Optional[str]]:
    """The placement the actor gets and its py_executable (None unless exec), from the node's resolution."""
    placement = ProcessPlacement.from_json(resolved["placement_json"])
    if placement.strategy != Strategy.EXEC:
        return placement, None
    command: Optional[ExecCommand] = None
    if not force_in_process:
        argv = resolved.get("exec_argv")
        problem = resolved.get("exec_problem") or exec_argv_problem(argv or ())
        command = ExecCommand(argv=tuple(argv), refusal=None) if problem is None else ExecCommand(
            argv=None, refusal=f"cannot start the Ray worker under numactl: {problem}")
    started = decide_start(placement, command, log=logger.warning)
    if started.strategy != Strategy.EXEC:
        return started, None
    return started, py_executable(command.argv)


# --------------------------------------------------------------------------- the launch


@dataclass
class LaunchedActor:
    """One rank's actor and what the driver knows of it."""

    rank: RankIdentity
    placement: ProcessPlacement
    name: str
    actor: Any
    node_id: str
    py_executable: Optional[str]
    resolve_s: float
    info: Optional[dict] = None
    binding: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.rank.label


@dataclass
class RayLaunch:
    """The placement group and the actors of one launch, with where the time went."""

    placement_group: Any
    actors: list[LaunchedActor] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    closed: bool = False


def _remaining(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _require_ray() -> None:
    if not ray.is_initialized():
        raise RuntimeError(
            "the Ray launcher needs a Ray cluster: call ray.init() (or ray.init(address=...)) before launching"
        )


def launch_scheduler_actors(
    server_args: Any,
    *,
    target: Target,
    timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
    force_in_process: bool = False,
    resolver: Optional[Callable[..., ProcessPlacement]] = None,
) -> RayLaunch:
    """Reserve one bundle per rank, resolve each rank on its node, and create its actor there.

    ``force_in_process`` makes every bound rank bind in-process (libnuma) rather
    than start under numactl. ``resolver`` replaces
    ``sglang.srt.placement.resolve_rank`` (same keyword arguments) in the task
    that runs on the rank's node. On any failure nothing is left behind.
    """
    _require_ray()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ranks = engine_ranks(server_args)
    resources = rank_resources(server_args.device)
    resource = accelerator_resource(server_args.device)
    bundle = rank_bundle(server_args.device)
    strategy = "STRICT_PACK" if server_args.nnodes == 1 else "PACK"

    started = time.perf_counter()
    group = placement_group([dict(bundle) for _ in ranks], strategy=strategy)
    launch = RayLaunch(placement_group=group)
    try:
        ready, _ = ray.wait([group.ready()], timeout=_remaining(deadline))
        if not ready:
            raise RankLaunchError(
                f"the Ray placement group for {len(ranks)} rank(s) ({len(ranks)} x {bundle}, {strategy}) was not "
                f"reserved within {timeout_s:.0f} s; free cluster resources: {ray.available_resources()}. "
                f"Free or add resources, or lower --tp-size/--pp-size/--dp-size."
            )
        launch.timings["placement_group_s"] = time.perf_counter() - started

        env = forwarded_env()
        started = time.perf_counter()
        refs = [
            resolve_on_node_task.options(
                **resources,
                max_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
            ).remote(
                server_args=node_args,
                rank=rank,
                env=env,
                accelerator_resource=resource,
                exec_supported=not force_in_process,
                resolver=resolver,
            )
            for index, (node_args, rank) in enumerate(ranks)
        ]
        resolved = _get_each(refs, [rank for _, rank in ranks], deadline=deadline, timeout_s=timeout_s,
                             stage="placement could not be resolved on its node")
        launch.timings["resolve_s"] = time.perf_counter() - started

        started = time.perf_counter()
        group_hex = group.id.hex()
        for index, ((_, rank), res) in enumerate(zip(ranks, resolved)):
            placement, exec_command = start_decision(rank=rank, resolved=res, force_in_process=force_in_process)
            runtime_env: dict[str, Any] = {}
            if env:
                runtime_env["env_vars"] = dict(env)
            if exec_command is not None:
                runtime_env["py_executable"] = exec_command
            name = actor_name(rank, group_hex=group_hex)
            actor = SchedulerActor.options(
                name=name,
                **resources,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=index
                ),
                runtime_env=runtime_env or None,
            ).remote(
                server_args=server_args,
                placement_json=placement.to_json(),
                rank=rank,
                target=target,
                resolved_node_id=res["node_id"],
                resolved_accelerator_ids=tuple(res["accelerator_ids"]),
                accelerator_resource=resource,
            )
            launch.actors.append(
                LaunchedActor(
                    rank=rank, placement=placement, name=name, actor=actor, node_id=res["node_id"],
                    py_executable=exec_command, resolve_s=res["resolve_s"],
                )
            )
            how = f"under {exec_command}" if exec_command else f"strategy {placement.strategy}"
            logger.info(f"{rank.label}: scheduler actor {name} created on node {res['node_id'][:12]} {how}")
        launch.timings["create_s"] = time.perf_counter() - started
    except BaseException:
        shutdown_ray(launch)
        raise
    return launch


def _get_each(refs: Sequence[Any], ranks: Sequence[RankIdentity], *, deadline: Optional[float],
              timeout_s: Optional[float], stage: str) -> list[Any]:
    """ray.get each ref, naming the rank of the first that fails or is late."""
    index_of = {ref: i for i, ref in enumerate(refs)}
    values: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=_remaining(deadline))
        if not done:
            labels = ", ".join(ranks[index_of[ref]].label for ref in pending)
            raise RankLaunchError(f"{labels}: {stage}: no answer within {timeout_s:.0f} s",
                                  label=ranks[index_of[pending[0]]].label)
        for ref in done:
            i = index_of[ref]
            try:
                values[i] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RankLaunchError(f"{ranks[i].label}: {stage}: {exc}", label=ranks[i].label,
                                      error=str(exc)) from exc
    return values


def _wait_all(launch: RayLaunch, *, call: Callable[[LaunchedActor], Any], on_done: Callable[[LaunchedActor, Any], None],
              timeout_s: Optional[float], late: Callable[[list[LaunchedActor]], str]) -> None:
    """Call a remote method on every actor and hand each result to ``on_done`` as it comes; on the first
    failure or the deadline, shut all down and raise."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        by_ref = {call(a): a for a in launch.actors}
        pending = list(by_ref)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_remaining(deadline))
            if not done:
                stuck = [by_ref[ref] for ref in pending]
                raise RankLaunchError(late(stuck), label=stuck[0].label)
            for ref in done:
                on_done(by_ref[ref], ref)
    except BaseException:
        shutdown_ray(launch)
        raise


def wait_ready_ray(launch: RayLaunch, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Wait until every actor reports readiness; on the first failure or the deadline, shut all down and raise.

    A rank whose read-back binding differs from its placement is logged as a
    warning here (the actor refused to start instead under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1).
    """

    def late(stuck: list[LaunchedActor]) -> str:
        hint = ""
        if any(a.py_executable for a in stuck):
            hint = (" A worker that numactl or the interpreter refused to start never registers with Ray: "
                    "see the raylet log (raylet.out) on the rank's node.")
        return f"{', '.join(a.label for a in stuck)}: scheduler actor not ready within {timeout_s:.0f} s.{hint}"

    started = time.perf_counter()
    _wait_all(launch, call=lambda a: a.actor.ready.remote(), on_done=_take_report, timeout_s=timeout_s, late=late)
    launch.timings["ready_s"] = time.perf_counter() - started
    return [RankResult(placement=a.placement, rank=a.rank, info=a.info or {}) for a in launch.actors]


def _take_report(a: LaunchedActor, ref: Any) -> None:
    try:
        report = ray.get(ref)
    except ray.exceptions.RayError as exc:
        raise RankLaunchError(f"{a.label}: scheduler actor {a.name} died before it was ready: {exc}",
                              label=a.label, error=str(exc)) from exc
    a.binding = report.get("binding") or {}
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
    else:
        from sglang.srt.placement.resolve import describe

        logger.info(f"{a.label}: scheduler actor ready (pid {pid}): {describe(a.placement)}")


def wait_finished_ray(launch: RayLaunch, *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
    """Run every actor's event loop until it returns; on failure or the deadline, shut all down and raise."""

    def finished(a: LaunchedActor, ref: Any) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise RankLaunchError(f"{a.label}: scheduler event loop failed: {exc}", label=a.label,
                                  error=str(exc)) from exc

    _wait_all(launch, call=lambda a: a.actor.event_loop.remote(), on_done=finished, timeout_s=timeout_s,
              late=lambda stuck: f"{', '.join(a.label for a in stuck)}: event loop still running after "
                                 f"{timeout_s:.0f} s")


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
    force_in_process: bool = False,
    resolver: Optional[Callable[..., ProcessPlacement]] = None,
) -> list[RankResult]:
    """Start every rank of the engine as a Ray actor, wait for readiness, run the event loops out, shut down.

    Each RankResult carries the placement resolved on the actor's node (not the
    driver's). Raises :class:`RankLaunchError` naming the failed rank with its
    error and traceback, and leaves no actor or placement group behind.
    """
    launch = launch_scheduler_actors(
        server_args, target=target, timeout_s=timeout_s, force_in_process=force_in_process, resolver=resolver
    )
    try:
        results = wait_ready_ray(launch, timeout_s=timeout_s)
        wait_finished_ray(launch, timeout_s=timeout_s)
        return results
    finally:
        shutdown_ray(launch)
