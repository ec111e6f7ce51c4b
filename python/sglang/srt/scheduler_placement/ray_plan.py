"""Ray's planning round: the values passed between driver, nodes and actors, the
decisions on them, and the tasks that run on each node.

The first ``_create_scheduler_actor`` call for a placement group
(``ray_actors``) runs ``probe_site`` in each bundle, holding all of its GPUs
so that Ray hands it every id an actor there may get, then ``plan_on_node``
once per node: one ``Candidate`` per id, every id of the node placed together.
Each call then decides what its actor starts with (``start_for_rank``), and
the actor takes the candidate of the id Ray gives it (``actor_choice``).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import ray

from sglang.srt.placement.types import (
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

if TYPE_CHECKING:
    from sglang.srt.placement.policy import PlacementPolicy

GPU = "GPU"
"""The Ray resource a scheduler actor holds (one per actor, whatever the device)."""

_NUMACTL_OPTION = re.compile(r"--[a-z][a-z-]*(=[0-9][0-9,-]*)?")
_ABSOLUTE_PATH = re.compile(r"/[A-Za-z0-9_.+@/-]*")
# A node plans ids, not ranks: each id is placed as this rank, with the id's GPU id.
_STAND_IN = RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=None)


@dataclass(frozen=True)
class BundleSite:
    """Where a placement-group bundle is, and every GPU id Ray reserved in it."""

    bundle_index: int
    node_id: str
    accelerator_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A rank's placement, planned on its node, if Ray gives it ``accelerator_id``.

    ``exec_argv`` ([numactl, *options, python]) starts it there, else
    ``exec_problem`` says why nothing can. ``error`` replaces the placement when a
    setting does not fit the id: the rank that gets it fails with that error, as
    sglang's own actor would.
    """

    accelerator_id: Optional[str]
    placement: Optional[ProcessPlacement]
    exec_argv: Optional[tuple[str, ...]] = None
    exec_problem: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class ActorStart:
    """What a ``SchedulerActor`` starts its rank with: a candidate per GPU id Ray may
    give it, planned on ``node_id``, or none (``unplanned`` says why: it places its own
    GPU under ``policy``). ``policy`` None: placement is off (the legacy bind runs in
    ``configure_scheduler_process``)."""

    policy: Optional["PlacementPolicy"]
    node_id: Optional[str] = None
    candidates: tuple[Candidate, ...] = ()
    unplanned: str = ""

    @property
    def enforced(self) -> bool:
        # With one candidate the driver knows the placement and applies the failure
        # policy itself, so the actor does not warn a second time.
        return len(self.candidates) == 1


# ------------------------------------------------------------------ the start decision


def py_executable(argv: Sequence[str]) -> str:
    """The ``runtime_env["py_executable"]`` string for [numactl, *options, python].

    Ray 2.60 does not exec it as an argv: the worker is started by ``bash -c
    "exec <py_executable> <quoted worker args>"`` (``RuntimeEnvContext.exec_worker``),
    so a shell splits and expands it. Every token must therefore match a strict
    pattern (an absolute path, or a numactl option whose value is digits, commas
    and dashes); one that does not (a Python path with a space) raises
    ValueError naming it, and the rank binds in-process instead.
    """
    if len(argv) < 2:
        raise ValueError(
            f"the exec command {list(argv)!r} needs at least numactl and a Python "
            "interpreter"
        )
    numactl, *options, python = argv
    for what, path in (("numactl path", numactl), ("Python interpreter path", python)):
        if not _ABSOLUTE_PATH.fullmatch(path):
            raise ValueError(
                f"the {what} {path!r} is not an absolute path of letters, digits and "
                "_.+@/- only (Ray runs py_executable through a shell)"
            )
    for option in options:
        if not _NUMACTL_OPTION.fullmatch(option):
            raise ValueError(
                f"the numactl option {option!r} is not of the form "
                "--name=digits,commas,dashes"
            )
    # Quoting is a no-op for tokens that passed the check; it stays as a second guard.
    return " ".join(shlex.quote(token) for token in argv)


def start_for_rank(
    candidates: Sequence[Candidate],
    *,
    rank: RankIdentity,
    policy: "PlacementPolicy",
    node_id: str,
) -> tuple[ActorStart, Optional[str]]:
    """What ``rank``'s actor starts with, from its bundle's candidates, and its
    py_executable (None unless exec).

    Exec needs one numactl command that is right whichever id Ray gives the
    actor, so candidates that bind differently all bind in-process instead,
    once the actor knows its id (by design, not a failure). A command that
    cannot be handed to Ray's shell demotes the same way, as a failure.
    """
    execs = [
        c for c in candidates if getattr(c.placement, "strategy", None) == Strategy.EXEC
    ]
    # A candidate with an error (no placement) binds like no other.
    bindings = {
        p
        and (p.strategy, p.numa_node, p.cpus, p.mem_nodes, p.mem_policy, p.numactl_args)
        for p in (c.placement for c in candidates)
    }
    command, why, failure = None, "", False
    if execs and len(bindings) > 1:
        ids = ", ".join(str(c.accelerator_id) for c in candidates)
        why = (
            f"GPU ids {ids} that Ray may give this rank bind differently; "
            "the actor binds in-process once it knows its id"
        )
    elif execs:
        try:
            if execs[0].exec_problem:
                raise ValueError(execs[0].exec_problem)
            command = py_executable(execs[0].exec_argv or ())
        except ValueError as exc:
            why, failure = f"cannot start the Ray worker under numactl: {exc}", True

    def for_rank(p: ProcessPlacement) -> ProcessPlacement:
        # Told which rank it is for; its GPU id stays the device's, when it has one.
        gpu_id = rank.gpu_id if p.rank.gpu_id is None else p.rank.gpu_id
        p = p.replace(rank=replace(rank, gpu_id=gpu_id))
        if not why or p.strategy != Strategy.EXEC:
            return p
        return p.replace(
            strategy=Strategy.IN_PROCESS,
            numactl_args=(),
            reasons=(*p.reasons, f"{why}: in-process bind with libnuma"),
            warning=p.warning or failure,
        )

    candidates = tuple(
        c if c.placement is None else replace(c, placement=for_rank(c.placement))
        for c in candidates
    )
    return ActorStart(policy=policy, node_id=node_id, candidates=candidates), command


def actor_choice(
    start: ActorStart, accelerator_ids: Sequence[str], *, node_id: str
) -> tuple[Optional[Candidate], str]:
    """The candidate of the GPU id Ray gave the actor, or None and why the actor must
    place its own (a plan made on another node, or for other ids, says nothing about
    this actor)."""
    if not start.candidates:
        return None, start.unplanned or "no plan was made for this rank's bundle"
    if node_id != start.node_id:
        return None, (
            f"its bundle was planned on Ray node {start.node_id}, but the actor runs "
            f"on node {node_id}"
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


# ------------------------------------------------------------------------ on each node


def accelerator_ids_here() -> tuple[str, ...]:
    """The GPU ids Ray assigned to the calling task or actor."""
    ids = ray.get_runtime_context().get_accelerator_ids().get(GPU, [])
    return tuple(str(i) for i in ids)


def probe_site(bundle_index: int, *after: BundleSite) -> BundleSite:
    """Where this task's bundle is and the GPU ids it holds (run in the bundle,
    holding all of them); ``after``, the previous probe's site on the node, only makes
    Ray run them one by one.
    """
    node_id = ray.get_runtime_context().get_node_id()
    return BundleSite(bundle_index, node_id, accelerator_ids_here())


def plan_on_node(
    server_args: Any, policy: "PlacementPolicy", *sites: BundleSite
) -> dict[int, tuple[Candidate, ...]]:
    """One candidate per GPU id of the bundles of ``sites``, all placed together (a Ray
    task on their node).

    It holds no GPU: it places the ids it is given (never its own
    ``CUDA_VISIBLE_DEVICES``) on the node's own topology (its
    ``SGLANG_SYSFS_ROOT``) under the driver's policy. An exec command is checked by
    numactl's dry run here: a worker numactl refuses never registers with Ray, and
    the launch would only learn of it at its deadline.
    """
    from sglang.srt.placement.plan import HostFacts

    node_id = ray.get_runtime_context().get_node_id()
    pairs = []
    for site in sites:
        if site.node_id != node_id:
            raise RuntimeError(
                f"bundle {site.bundle_index} is on Ray node {site.node_id}, not on "
                f"this node {node_id} that Ray's placement-group table named"
            )
        pairs += [(site.bundle_index, id_) for id_ in site.accelerator_ids]
    ids = [accelerator_id for _, accelerator_id in pairs]
    planned = plan_ids(server_args, ids, policy=policy, facts=HostFacts.live())
    by_bundle: dict[int, tuple[Candidate, ...]] = {}
    for (index, accelerator_id), outcome in zip(pairs, planned):
        if isinstance(outcome, str):
            candidate = Candidate(accelerator_id, placement=None, error=outcome)
        else:
            where = f"resolved on Ray node {node_id}"
            placement = outcome.replace(reasons=(*outcome.reasons, where))
            candidate = Candidate(
                accelerator_id, placement, *_exec_argv_here(placement)
            )
        by_bundle[index] = (*by_bundle.get(index, ()), candidate)
    return by_bundle


def plan_ids(
    server_args: Any,
    accelerator_ids: Sequence[str],
    *,
    policy: Any,
    facts: Any,
) -> list[Union[ProcessPlacement, str]]:
    """A placement per Ray GPU id of one node, all placed together, or the error that
    id's rank would meet: a setting that does not fit one id (a ``--numa-node`` list
    too short for it) fails only the ranks that get it, and the other ids are still
    placed together."""
    from sglang.srt.placement.plan import plan_node

    found: list[Union[tuple[RankIdentity, str], str]] = []
    for accelerator_id in accelerator_ids:
        text = str(accelerator_id).strip()
        # sglang's SchedulerActor takes int(ray_id) as its device: it indexes
        # --numa-node, and bootstrap hands it to a CPU rank's init_threads_binding as
        # numa_index.
        if text.isdigit():
            found.append((replace(_STAND_IN, gpu_id=int(text)), accelerator_id))
        else:
            found.append(
                f"Ray's GPU id {text!r} is not an integer, but sglang's SchedulerActor "
                "uses int(id) as the rank's GPU id; give the raylet "
                "CUDA_VISIBLE_DEVICES as indices"
            )

    def place(pairs: list) -> Sequence[ProcessPlacement]:
        return plan_node(server_args, ranks_with_ids=pairs, policy=policy, facts=facts)

    def place_all() -> Sequence[ProcessPlacement]:
        good = [item for item in found if not isinstance(item, str)]
        return place(good) if good else ()

    try:
        placed = place_all()
    except (ValueError, PlacementError):
        # Find the ids the setting does not fit, then place the others together again.
        for i, item in enumerate(found):
            if isinstance(item, str):
                continue
            try:
                place([item])
            except (ValueError, PlacementError) as exc:
                found[i] = _unlabelled(str(exc))
        placed = place_all()
    rest = iter(placed)
    return [item if isinstance(item, str) else next(rest) for item in found]


def _unlabelled(text: str) -> str:
    """``text`` without the stand-in's label (the actor adds its own)."""
    return text.replace(f"{_STAND_IN.label}: ", "").replace(_STAND_IN.label, "the rank")


def _exec_argv_here(
    placement: ProcessPlacement,
) -> tuple[Optional[tuple[str, ...]], Optional[str]]:
    """[numactl, *options, python] that starts an exec ``placement`` here, or why there
    is none."""
    from sglang.srt.placement.numactl import exec_refusal, numactl_prefix

    if placement.strategy != Strategy.EXEC:
        return None, None
    try:
        prefix = numactl_prefix(placement)
    except FileNotFoundError as exc:
        return None, f"numactl was not found on this node ({_unlabelled(str(exc))})"
    complaint = exec_refusal(placement)
    if complaint is not None:
        return None, (
            f"numactl {' '.join(placement.numactl_args)} does not start on this node: "
            f"{complaint}"
        )
    return (*prefix, sys.executable), None


probe_site_task = ray.remote(probe_site)
plan_on_node_task = ray.remote(plan_on_node)
