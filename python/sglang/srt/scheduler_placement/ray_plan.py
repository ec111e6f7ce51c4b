"""The values that pass between the Ray driver, each node and each actor, and the pure decisions on them.

sglang's ``RayEngine`` reserves a placement group and calls
``_create_scheduler_actor`` once per rank. The first call plans the whole
group: where each bundle is and which GPU ids Ray reserved in it
(``BundleSite``), then, on each node, one ``Candidate`` placement per id
(``BundlePlan``, in a ``NodePlan``). Each call then decides what its rank's
actor starts with (``ActorStart``) and, when it starts under numactl, the
``py_executable``; the actor takes the candidate of the id Ray gives it
(``actor_choice``). Nothing here imports Ray.

Ray 2.60 does not exec ``py_executable`` as an argv: the worker is started by
``bash -c "exec <py_executable> <quoted worker args>"``
(``RuntimeEnvContext.exec_worker``), so the string is split and expanded by a
shell. Every token is therefore checked against a strict pattern (an absolute
path, or a numactl option whose value is digits, commas and dashes) before it
is joined; a token that fails (say, a Python path with a space) makes the rank
bind in-process instead, with the reason in its placement.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy

if TYPE_CHECKING:
    from sglang.srt.placement.policy import PlacementPolicy

_NUMACTL_OPTION = re.compile(r"--[a-z][a-z-]*(=[0-9][0-9,-]*)?")
_ABSOLUTE_PATH = re.compile(r"/[A-Za-z0-9_.+@/-]*")


# --------------------------------------------------------------------------- the values


@dataclass(frozen=True)
class BundleSite:
    """Where a placement-group bundle is, and every GPU id Ray reserved in it."""

    bundle_index: int
    node_id: str
    node_ip: str
    accelerator_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A rank's placement if Ray gives it ``accelerator_id``, with the node's numactl argv.

    ``error`` says why there is no placement for this id (a setting that does
    not fit it, such as a ``--numa-node`` list too short for it): the rank that
    gets this id fails with that error, as sglang's own actor would.
    """

    accelerator_id: Optional[str]
    placement: Optional[ProcessPlacement]
    exec_argv: Optional[tuple[str, ...]] = None
    """[numactl, *options, python] for an exec placement that numactl accepts on the node."""
    exec_problem: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class BundlePlan:
    """A bundle's plan from its node: one candidate per GPU id reserved in it.

    Every rank that RayEngine starts in the bundle may get any of these ids
    (Ray picks one only as the actor starts).
    """

    bundle_index: int
    candidates: tuple[Candidate, ...]

    @property
    def agreed(self) -> bool:
        """True when every candidate binds the same way, so an actor can start under that binding
        before it knows its id (the placements differ only in the device they name)."""
        if any(c.error is not None for c in self.candidates):
            return len(self.candidates) == 1
        first = _binding(self.candidates[0].placement)
        return all(_binding(c.placement) == first for c in self.candidates[1:])


@dataclass(frozen=True)
class NodeRequest:
    """What the driver asks a node to plan: its bundles, under the engine's policy.

    The ids of each bundle come from the bundle's site, passed to the node's
    task as it starts. The policy is the driver's (engine settings, read once
    there); host facts, SGLANG_SYSFS_ROOT included, are the node's own.
    """

    server_args: object
    """The placement fields of the engine's ServerArgs (``placement_view``)."""
    bundles: tuple[int, ...]
    policy: "PlacementPolicy"


@dataclass(frozen=True)
class NodePlan:
    """What a node planned for its bundles: their sites, a plan per bundle, and how long that took."""

    node_id: str
    node_ip: str
    sites: tuple[BundleSite, ...]
    bundles: tuple[BundlePlan, ...]
    resolve_s: float = 0.0


@dataclass(frozen=True)
class ActorStart:
    """What a ``SchedulerActor`` starts its rank with.

    ``policy`` is None when placement is off (``SGLANG_NUMA_BIND_V2=0``: the
    legacy bind runs in ``configure_scheduler_process``). Otherwise
    ``candidates`` holds the placement per GPU id Ray may give the actor, planned
    on ``node_id``; with none (the plan could not be made: ``unplanned`` says
    why), the actor resolves its own placement under ``policy``. ``enforced``
    is True when the driver already applied the failure policy to the rank's
    one candidate, so the actor does not warn a second time.
    """

    rank: RankIdentity
    policy: Optional["PlacementPolicy"]
    node_id: Optional[str] = None
    candidates: tuple[Candidate, ...] = ()
    enforced: bool = False
    unplanned: str = ""


def _binding(p: Optional[ProcessPlacement]) -> tuple:
    if p is None:
        return ()
    return (p.strategy, p.numa_node, p.cpus, p.mem_nodes, p.mem_policy, p.numactl_args)


# --------------------------------------------------------------------------- the id a rank uses


def rank_gpu_id(accelerator_id: Optional[str]) -> tuple[Optional[int], Optional[str]]:
    """The GPU id sglang's ``SchedulerActor`` uses for Ray's ``accelerator_id``, or None and why not.

    The actor takes ``int(ray_id)`` as its device (``publish(gpu_id=...)``):
    it indexes ``--numa-node``, and bootstrap hands it to a CPU rank's
    ``init_threads_binding`` as ``numa_index``.
    """
    if accelerator_id is None:
        return None, None
    text = str(accelerator_id).strip()
    if not text.isdigit():
        return None, (
            f"Ray's GPU id {text!r} is not an integer, but sglang's SchedulerActor uses int(id) as the "
            "rank's GPU id; give the raylet CUDA_VISIBLE_DEVICES as indices"
        )
    return int(text), None


def for_rank(placement: ProcessPlacement, rank: RankIdentity) -> ProcessPlacement:
    """A bundle's placement, told which rank it is for (its GPU id stays the device's, when it has one)."""
    gpu_id = placement.gpu_id if placement.gpu_id is not None else rank.gpu_id
    return placement.replace(
        dp_rank=rank.dp_rank, pp_rank=rank.pp_rank, tp_rank=rank.tp_rank, gpu_id=gpu_id
    )


# --------------------------------------------------------------------------- the start decision


def demote_to_in_process(
    placement: ProcessPlacement, *, why: str, failure: bool = False
) -> ProcessPlacement:
    """``placement`` with strategy in-process instead of exec, ``why`` appended to its reasons.

    ``failure`` marks it less bound than planned (exec was intended and is not
    possible); the edge that applies it then warns, or raises under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
    """
    reason = f"{why}: in-process bind with libnuma"
    return placement.replace(
        strategy=Strategy.IN_PROCESS,
        numactl_args=(),
        reasons=(*placement.reasons, reason),
        warning=placement.warning or failure,
    )


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


def _with_placement(candidate: Candidate, placement: ProcessPlacement) -> Candidate:
    return Candidate(
        accelerator_id=candidate.accelerator_id,
        placement=placement,
        exec_argv=candidate.exec_argv,
        exec_problem=candidate.exec_problem,
    )


def start_for_rank(
    plan: BundlePlan, *, rank: RankIdentity, policy: "PlacementPolicy", node_id: str
) -> tuple[ActorStart, Optional[str]]:
    """What ``rank``'s actor in ``plan``'s bundle starts with, and its py_executable (None unless exec).

    Exec needs one numactl command that is right whichever id Ray gives the
    actor, so candidates that bind differently all bind in-process instead,
    each once the actor knows its id (by design, not a failure). A command that
    cannot be handed to Ray's shell demotes the same way, as a failure.
    """
    candidates = tuple(
        c if c.placement is None else _with_placement(c, for_rank(c.placement, rank))
        for c in plan.candidates
    )
    start = ActorStart(
        rank=rank,
        policy=policy,
        node_id=node_id,
        candidates=candidates,
        enforced=len(candidates) == 1,
    )
    execs = [
        c
        for c in candidates
        if c.placement is not None and c.placement.strategy == Strategy.EXEC
    ]
    if not execs:
        return start, None
    if not plan.agreed:
        ids = ", ".join(str(c.accelerator_id) for c in candidates)
        why = (
            f"GPU ids {ids} that Ray may give this rank bind differently; "
            "the actor binds in-process once it knows its id"
        )
        return _demoted(start, why=why, failure=False), None
    first = execs[0]
    problem = first.exec_problem or exec_argv_problem(first.exec_argv or ())
    if problem is not None:
        why = f"cannot start the Ray worker under numactl: {problem}"
        return _demoted(start, why=why, failure=True), None
    return start, py_executable(first.exec_argv)


def _demoted(start: ActorStart, *, why: str, failure: bool) -> ActorStart:
    candidates = tuple(
        (
            _with_placement(
                c, demote_to_in_process(c.placement, why=why, failure=failure)
            )
            if c.placement is not None and c.placement.strategy == Strategy.EXEC
            else c
        )
        for c in start.candidates
    )
    return ActorStart(
        rank=start.rank,
        policy=start.policy,
        node_id=start.node_id,
        candidates=candidates,
        enforced=start.enforced,
        unplanned=start.unplanned,
    )


def actor_choice(
    start: ActorStart, accelerator_ids: Sequence[str], *, node_id: str
) -> tuple[Optional[Candidate], str]:
    """The candidate of the GPU id Ray gave the actor, or None and why the actor must resolve its own.

    A plan made on another node, or for other ids than the one Ray gave, says
    nothing about this actor: it then places the device it has, on its node.
    """
    if not start.candidates:
        return None, start.unplanned or "no plan was made for this rank's bundle"
    if start.node_id is not None and node_id != start.node_id:
        return None, (
            f"its bundle was planned on Ray node {start.node_id}, but the actor runs on node {node_id}"
        )
    own = str(accelerator_ids[0]) if accelerator_ids else None
    for candidate in start.candidates:
        if candidate.accelerator_id == own:
            return candidate, ""
    planned = [c.accelerator_id for c in start.candidates]
    return (
        None,
        f"its bundle was planned for GPU ids {planned}, but Ray gave the actor {own!r}",
    )
