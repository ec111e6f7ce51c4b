"""The typed values that pass between the Ray driver, each node and each actor, and the pure decisions made on them.

A launch goes: where is each bundle (``BundleSite``) -> which ranks run in which
bundle, with which candidate accelerator ids (``RankOnNode``) -> each node's
plan for its ranks, one placement per candidate (``NodePlan`` of ``RankPlan``)
-> what each actor starts with (``ActorStart``), and the py_executable that
starts its worker under numactl. Nothing here imports Ray.

Ray 2.60 does not exec ``py_executable`` as an argv: the worker is started by
``bash -c "exec <py_executable> <quoted worker args>"`` (``RuntimeEnvContext.exec_worker``),
so the string is split and expanded by a shell. Every token is therefore
checked against a strict pattern (an absolute path, or a numactl option whose
value is digits, commas and dashes) before it is joined; a token that fails
(say, a Python path with a space) makes the rank bind in-process instead, with
the reason in its placement.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy
from sglang.srt.placement import settings
from sglang.srt.placement.types import PlacementError

if TYPE_CHECKING:
    from sglang.srt.placement.policy import PlacementPolicy

_NUMACTL_OPTION = re.compile(r"--[a-z][a-z-]*(=[0-9][0-9,-]*)?")
_ABSOLUTE_PATH = re.compile(r"/[A-Za-z0-9_.+@/-]*")


# --------------------------------------------------------------------------- the values


@dataclass(frozen=True)
class BundleSite:
    """Where a placement-group bundle is: its node, and every accelerator id Ray assigns in it (() for CPU bundles)."""

    bundle_index: int
    node_id: str
    node_ip: str
    accelerator_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankOnNode:
    """A rank, the bundle it starts in, and the accelerator ids it may get there.

    One id when the bundle holds exactly the rank's accelerator; several when the
    bundle holds more and Ray picks one only as the actor starts; none for CPU ranks.
    """

    rank: RankIdentity
    bundle_index: int
    accelerator_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A rank's placement if it gets ``accelerator_id``, with the node's numactl argv or why there is none."""

    accelerator_id: Optional[str]
    placement: ProcessPlacement
    exec_argv: Optional[tuple[str, ...]] = None
    """[numactl, *options, python] for an exec placement whose options numactl accepts on the node."""
    exec_problem: Optional[str] = None


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan from its node: a candidate per accelerator id it may get (one for CPU ranks)."""

    rank: RankIdentity
    bundle_index: int
    candidates: tuple[Candidate, ...]

    @property
    def agreed(self) -> bool:
        """True when every candidate binds the same way, so the rank can start under that binding before
        knowing which id it gets (the placements differ only in the device they name)."""
        first = _binding(self.candidates[0].placement)
        return all(_binding(c.placement) == first for c in self.candidates[1:])


@dataclass(frozen=True)
class NodeRequest:
    """What the driver asks a node to resolve: its ranks in their bundles, under the engine's policy.

    Each rank's candidate ids are its bundle's, from the bundle's site, learnt
    as the node's task starts, so the driver need not wait for them first. The
    policy is the driver's (engine settings, read once there); host facts,
    SGLANG_SYSFS_ROOT included, are the node's own.
    """

    server_args: object
    ranks: tuple[tuple[RankIdentity, int], ...]
    """(rank, bundle index) pairs, in launch order."""
    policy: "PlacementPolicy"
    gpus: Optional[tuple[str, ...]] = None
    """``--gpus``: PCI addresses by physical device index, for every node alike."""


@dataclass(frozen=True)
class NodePlan:
    """What a node resolved for its ranks: its bundles' sites, a plan per rank, and how long that took."""

    node_id: str
    node_ip: str
    sites: tuple[BundleSite, ...]
    ranks: tuple[RankPlan, ...]
    resolve_s: float = 0.0
    pid: int = 0


@dataclass(frozen=True)
class ActorStart:
    """What a ``SchedulerActor`` starts its rank with: who it is, where it was planned, its placement per id.

    ``candidates`` is empty when placement is off. The actor takes the candidate
    of the accelerator Ray gave it; ``node_id`` is the node its plan was made on.
    """

    rank: RankIdentity
    accelerator_resource: str
    node_id: Optional[str] = None
    candidates: tuple[tuple[Optional[str], ProcessPlacement], ...] = ()

    @property
    def placed(self) -> bool:
        return bool(self.candidates)


def _binding(p: ProcessPlacement) -> tuple:
    return (p.strategy, p.numa_node, p.cpus, p.mem_nodes, p.mem_policy, p.numactl_args)


# --------------------------------------------------------------------------- pairing ranks with sites


def ranks_on_sites(ranks_and_bundles: Sequence[tuple[RankIdentity, int]],
                   sites: Mapping[int, BundleSite]) -> tuple[RankOnNode, ...]:
    """Each rank in its bundle, with every accelerator id of that bundle as its candidates."""
    return tuple(RankOnNode(rank=rank, bundle_index=index, accelerator_ids=sites[index].accelerator_ids)
                 for rank, index in ranks_and_bundles)


def by_node(ranks_and_bundles: Sequence[tuple[RankIdentity, int]],
            node_of_bundle: Mapping[int, str]) -> dict[str, tuple[tuple[RankIdentity, int], ...]]:
    """The (rank, bundle index) pairs grouped by the node their bundle is on, in launch order within a node."""
    grouped: dict[str, list[tuple[RankIdentity, int]]] = {}
    for rank, index in ranks_and_bundles:
        grouped.setdefault(node_of_bundle[index], []).append((rank, index))
    return {node: tuple(members) for node, members in grouped.items()}


# --------------------------------------------------------------------------- the exec decision


def demote_to_in_process(placement: ProcessPlacement, *, why: str) -> ProcessPlacement:
    """``placement`` with strategy in-process instead of exec, ``why`` appended to its reasons."""
    reason = f"{why}: in-process bind with libnuma"
    return placement.replace(strategy=Strategy.IN_PROCESS, numactl_args=(), reasons=(*placement.reasons, reason))


@dataclass(frozen=True)
class ExecCommand:
    """The argv that starts a rank under numactl ([numactl, *options, python]), or why it cannot."""

    argv: Optional[tuple[str, ...]]
    refusal: Optional[str] = None
    """Why there is no argv: numactl is missing, or numactl's own complaint about the options."""
    numactl_missing: bool = False

    @property
    def prefix(self) -> Optional[tuple[str, ...]]:
        """The argv without the Python interpreter (what goes in front of a spawned child's command)."""
        return None if self.argv is None else self.argv[:-1]


def exec_command(placement: ProcessPlacement, *, python: str) -> ExecCommand:
    """The numactl argv for an exec ``placement`` on this host, checked by numactl's own dry run (cached)."""
    from sglang.srt.placement.numactl import exec_refusal, numactl_prefix

    try:
        prefix = numactl_prefix(placement)
    except FileNotFoundError as exc:
        return ExecCommand(argv=None, refusal=f"numactl was not found at launch ({exc})", numactl_missing=True)
    complaint = exec_refusal(placement)
    if complaint is not None:
        return ExecCommand(argv=None, refusal=complaint)
    return ExecCommand(argv=(*prefix, python))


def decide_start(placement: ProcessPlacement, command: Optional[ExecCommand], *,
                 log: Callable[[str], None]) -> ProcessPlacement:
    """The placement a rank starts with: exec stays exec when ``command`` has an argv, else it is demoted.

    Under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 a refused exec is an error rather
    than a demotion, since the rank would not start the way it was planned.
    """
    if placement.strategy != Strategy.EXEC or (command is not None and command.argv is not None):
        return placement
    why = command.refusal if command is not None else "the launcher was asked to bind in-process"
    if command is not None and settings.bind_failure_is_fatal():
        raise PlacementError(f"{placement.label}: {why} (SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1)")
    if command is not None:
        log(f"{placement.label}: {why}; binding in-process instead")
    return demote_to_in_process(placement, why=why)


def numactl_complaint(prefix: Sequence[str]) -> Optional[str]:
    """numactl's own complaint for ``prefix``, by running it again in front of ``true``; None if it now works."""
    from sglang.srt.placement.numactl import run_numactl

    result = run_numactl([*prefix, shutil.which("true") or "/bin/true"])
    return None if result.ok else result.message


# --------------------------------------------------------------------------- the start decision


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


def _command_of(candidate: Candidate) -> ExecCommand:
    problem = candidate.exec_problem or exec_argv_problem(candidate.exec_argv or ())
    if problem is None:
        return ExecCommand(argv=tuple(candidate.exec_argv))
    return ExecCommand(argv=None, refusal=f"cannot start the Ray worker under numactl: {problem}")


def start_decision(plan: RankPlan, *, accelerator_resource: str, node_id: str, force_in_process: bool = False,
                   log: Callable[[str], None]) -> tuple[ActorStart, Optional[str]]:
    """What the rank's actor starts with, and its py_executable (None unless it starts under numactl).

    Exec needs one numactl command that is right whichever candidate id Ray
    gives the actor, so candidates that bind differently all bind in-process
    instead, each once the actor knows its id. A refused or unsafe command
    demotes the same way (an error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1).
    """
    first = plan.candidates[0]
    command: Optional[ExecCommand] = None
    if first.placement.strategy == Strategy.EXEC and not force_in_process:
        command = _command_of(first)
    if not plan.agreed:
        ids = ", ".join(str(c.accelerator_id) for c in plan.candidates)
        why = (f"{accelerator_resource} ids {ids} that Ray may give this rank bind differently; "
               f"the actor binds in-process once it knows its id")
        candidates = tuple((c.accelerator_id, _demoted(c.placement, why=why)) for c in plan.candidates)
        return ActorStart(rank=plan.rank, accelerator_resource=accelerator_resource, node_id=node_id,
                          candidates=candidates), None
    started = decide_start(first.placement, command, log=log)
    exec_string = py_executable(command.argv) if started.strategy == Strategy.EXEC else None
    if started is first.placement:
        candidates = tuple((c.accelerator_id, c.placement) for c in plan.candidates)
    else:  # the demotion's reason was added to the first; the others take the same change
        why = started.reasons[-1]
        candidates = tuple((c.accelerator_id, c.placement.replace(
            strategy=started.strategy, numactl_args=started.numactl_args,
            reasons=(*c.placement.reasons, why))) for c in plan.candidates)
    return ActorStart(rank=plan.rank, accelerator_resource=accelerator_resource, node_id=node_id,
                      candidates=candidates), exec_string


def _demoted(placement: ProcessPlacement, *, why: str) -> ProcessPlacement:
    return demote_to_in_process(placement, why=why) if placement.strategy == Strategy.EXEC else placement


def unplaced_start(rank: RankIdentity, *, accelerator_resource: str) -> ActorStart:
    """What an actor starts with when the launch skips placement: no plan, nothing bound."""
    return ActorStart(rank=rank, accelerator_resource=accelerator_resource)


def actor_placement(start: ActorStart, accelerator_ids: Sequence[str], *,
                    node_id: str) -> tuple[Optional[ProcessPlacement], list[str]]:
    """The placement an actor applies for the ids Ray gave it, and each way its premises differ from its plan."""
    if not start.placed:
        return None, []
    premises: list[str] = []
    if start.node_id is not None and node_id != start.node_id:
        premises.append(f"placement resolved on Ray node {start.node_id}, actor runs on node {node_id}")
    own = str(accelerator_ids[0]) if accelerator_ids else None
    for candidate_id, placement in start.candidates:
        if candidate_id == own:
            return placement, premises
    planned = [candidate_id for candidate_id, _ in start.candidates]
    premises.append(f"placement resolved for {start.accelerator_resource} {planned}, "
                    f"Ray gave this actor {list(accelerator_ids)}")
    return start.candidates[0][1], premises

