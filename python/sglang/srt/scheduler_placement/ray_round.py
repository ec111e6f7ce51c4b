"""The driver's side of planning on an existing placement group: where each bundle is, and each node's plan.

Both take a placement group the caller reserved (ours, or upstream RayEngine's
own), so either launcher can use them. Every task is tiny, with no runtime_env
and no CPU, so it runs in an already started worker, and a node's tasks run
one after another, chained by Ray rather than by the driver; every wait is
bounded by the launch's deadline, and on failure the unfinished tasks are
cancelled and the error names the ranks concerned.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from sglang.srt.placement.types import RankIdentity
from sglang.srt.scheduler_placement.ray_node import Planner, plan_on_node_task, probe_site_task
from sglang.srt.scheduler_placement.ray_plan import BundleSite, NodePlan, NodeRequest, by_node

logger = logging.getLogger(__name__)


DEFAULT_TIMEOUT_S = 600.0


class RankLaunchError(RuntimeError):
    """A scheduler rank failed to start or to finish; the message names the rank and carries its traceback."""

    def __init__(self, message: str, *, label: str = "", error: str = "", child_traceback: str = "") -> None:
        super().__init__(message)
        self.label = label
        self.error = error
        self.child_traceback = child_traceback


class Deadline:
    """One deadline for a whole launch step (None: wait forever)."""

    def __init__(self, timeout_s: Optional[float]) -> None:
        self.timeout_s = timeout_s
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> Optional[float]:
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def text(self) -> str:
        return "ever" if self.timeout_s is None else f"{self.timeout_s:.0f} s"


def wait_for_all(
    items: Sequence[T],
    *,
    reached: Callable[[T], bool],
    wait_some: Callable[[list[T], Optional[float]], None],
    deadline: Deadline,
    late: Callable[[list[T]], BaseException],
    stop_all: Callable[[], None],
) -> None:
    """Wait until every item has ``reached`` its goal, all under one ``deadline``: both launchers' one wait loop.

    ``wait_some(pending, timeout)`` blocks until something may have changed for
    a pending item (or the timeout) and takes the step it can, raising at the
    first failure. On that failure, or at the deadline (``late(pending)`` is
    raised), ``stop_all`` stops every rank before the error goes up.
    """
    try:
        while True:
            pending = [item for item in items if not reached(item)]
            if not pending:
                return
            if deadline.expired():
                raise late(pending)
            wait_some(pending, deadline.remaining())
    except BaseException:
        stop_all()
        raise


def gather(labels: Mapping[Any, str], *, deadline: Deadline, late: str, failed: str, fix: str = "",
           cancel: bool = True) -> dict[Any, Any]:
    """ray.get every ref of ``labels`` (ref -> who it is for) within ``deadline``; on the first failure or the
    deadline, cancel the rest (task refs only: ``cancel=False`` for actor calls, whose actors the caller kills)
    and raise a RankLaunchError naming whom it concerns.

    The message is "<who>: <late> within <deadline>. <fix>" or "<who>: <failed>: <Ray's error>".
    """
    values: dict[Any, Any] = {}

    def step(pending: list[Any], timeout: Optional[float]) -> None:
        done, _ = ray.wait(pending, num_returns=1, timeout=timeout)
        for ref in done:
            try:
                values[ref] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RankLaunchError(f"{labels[ref]}: {failed}: {exc}", label=labels[ref], error=str(exc)) from exc

    def overdue(pending: list[Any]) -> RankLaunchError:
        who = ", ".join(labels[ref] for ref in pending)
        return RankLaunchError(f"{who}: {late} within {deadline.text()}. {fix}".rstrip(), label=labels[pending[0]])

    def cancel_the_rest() -> None:
        for ref in [ref for ref in labels if ref not in values] if cancel else ():
            try:
                ray.cancel(ref, force=True)  # force: a task stuck on its node must not outlive the launch
            except Exception as exc:  # noqa: BLE001 - the error being raised matters more than this one
                logger.warning(f"{labels[ref]}: could not cancel its Ray task: {exc}")

    wait_for_all(list(labels), reached=lambda ref: ref in values, wait_some=step, deadline=deadline, late=overdue,
                 stop_all=cancel_the_rest)
    return values


def _holding(resource: str, count: float) -> dict[str, Any]:
    """Task options that hold ``count`` of ``resource`` (nothing for CPU: the probe needs only its node)."""
    if resource == "CPU" or not count:
        return {"num_cpus": 0, "num_gpus": 0}
    if resource == "GPU":
        return {"num_cpus": 0, "num_gpus": count}
    return {"num_cpus": 0, "num_gpus": 0, "resources": {resource: count}}


def bundle_nodes(placement_group: Any) -> dict[int, str]:
    """The Ray node each bundle of a reserved placement group is on, from Ray's placement-group table."""
    return {int(index): node for index, node in placement_group_table(placement_group)["bundles_to_node_id"].items()}


def _probes(placement_group: Any, bundle_indices: Sequence[int], *, resource: str) -> dict[int, Any]:
    """One site probe per bundle, holding all of the bundle's ``resource``; the refs, not yet waited for.

    The probes of one node run one after another (each takes the previous one's
    result as an argument, so Ray orders them without the driver): tiny tasks
    started together would make Ray start a new worker process for each one
    beyond the node's idle workers, costing the actors that start next.
    """
    specs = placement_group.bundle_specs
    node_of = bundle_nodes(placement_group)
    refs: dict[int, Any] = {}
    last_on: dict[str, Any] = {}
    for index in bundle_indices:
        after = last_on.get(node_of[index])
        refs[index] = last_on[node_of[index]] = probe_site_task.options(
            **_holding(resource, specs[index].get(resource, 0)),
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=index),
        ).remote(index, resource, *([] if after is None else [after]))
    return refs


def discover_sites(placement_group: Any, bundle_indices: Sequence[int], *, resource: str, deadline: Deadline,
                   who: Optional[Callable[[int], str]] = None) -> dict[int, BundleSite]:
    """Where each bundle is and every ``resource`` id it holds: one task per bundle holding all of them.

    Ray gives an actor created in a one-accelerator bundle the same id that such
    a task saw; in a bundle of several, the actor gets one of the ids reported.
    ``who`` names a bundle's rank(s) in errors.
    """
    who = who or (lambda index: f"bundle {index}")
    probes = _probes(placement_group, bundle_indices, resource=resource)
    found = gather({ref: who(index) for index, ref in probes.items()}, deadline=deadline,
                   late="placement-group bundle not found", failed="the probe of its placement-group bundle failed",
                   fix="Check that the bundle's node is alive (ray status).")
    return {index: found[ref] for index, ref in probes.items()}


def resolve_on_nodes(ranks: Sequence[tuple[RankIdentity, int]], server_args: Any, *, placement_group: Any,
                     resource: str, policy: Any, deadline: Deadline,
                     sites: Optional[Mapping[int, BundleSite]] = None, gpus: Optional[Sequence[str]] = None,
                     planner: Optional[Planner] = None) -> tuple[NodePlan, ...]:
    """Each node's plan for the (rank, bundle index) pairs of its bundles, in one round trip from the driver.

    One zero-resource task per node runs on that node; Ray starts it once the
    probes of its bundles (one per accelerator bundle, holding all of its
    accelerators) are done, since their sites are its arguments: the driver
    waits once, for everything. ``sites`` already found by ``discover_sites``
    replace the probes. ``policy`` is the engine's ``PlacementPolicy`` (the
    driver's settings); ``planner`` replaces ``plan_node`` there, for tests.
    """
    in_bundle: dict[int, list[str]] = {}
    for rank, index in ranks:
        in_bundle.setdefault(index, []).append(rank.label)
    labels: dict[Any, str] = {}
    if sites is None:
        node_of = bundle_nodes(placement_group)
        found: Mapping[int, Any] = {}
        if resource != "CPU":  # a CPU bundle holds no id to learn; its node is in the table
            found = _probes(placement_group, sorted(in_bundle), resource=resource)
            labels.update({ref: ", ".join(in_bundle[index]) for index, ref in found.items()})
    else:
        node_of, found = {index: site.node_id for index, site in sites.items()}, sites
    node_refs = []
    for node_id, members in by_node(ranks, node_of).items():
        request = NodeRequest(server_args=server_args, ranks=members, policy=policy,
                              gpus=tuple(gpus) if gpus is not None else None)
        bundles = sorted({index for _, index in members})
        ref = plan_on_node_task.options(
            num_cpus=0, num_gpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(request, planner, *(found[index] for index in bundles if index in found))
        labels[ref] = ", ".join(rank.label for rank, _ in members)
        node_refs.append(ref)
    plans = gather(labels, deadline=deadline, late="placement not resolved on its node",
                   failed="placement could not be resolved on its node",
                   fix="Check that the node is alive (`ray status`) and see its raylet log (raylet.out), "
                       "or give the launch more time.")
    return tuple(plans[ref] for ref in node_refs)
