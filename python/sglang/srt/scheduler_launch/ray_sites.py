"""The driver's two rounds over an existing placement group: where each bundle is, then each node's plan for its ranks.

Both take a placement group the caller reserved (ours, or upstream RayEngine's
own), so either launcher can use them. Each round is one Ray task per bundle or
per node, with no runtime_env and no CPU, so it runs in an already started
worker; every wait is bounded by the launch's deadline, and on failure the
round's unfinished tasks are cancelled and the error names the ranks concerned.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from sglang.srt.scheduler_launch.common import Deadline, RankLaunchError
from sglang.srt.scheduler_launch.ray_node import Planner, plan_on_node_task, probe_site_task
from sglang.srt.scheduler_launch.ray_plan import BundleSite, NodePlan, NodeRequest, RankOnNode, by_node


def gather(labels: Mapping[Any, str], *, deadline: Deadline, late: str, failed: str, fix: str = "") -> dict[Any, Any]:
    """ray.get every ref of ``labels`` (ref -> who it is for) within ``deadline``; on the first failure or the
    deadline, cancel the rest and raise a RankLaunchError naming whom it concerns.

    The message is "<who>: <late> within <deadline>. <fix>" or "<who>: <failed>: <Ray's error>".
    """
    values: dict[Any, Any] = {}
    pending = list(labels)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
            if not done:
                who = ", ".join(labels[ref] for ref in pending)
                raise RankLaunchError(f"{who}: {late} within {deadline.text()}. {fix}".rstrip(),
                                      label=labels[pending[0]])
            for ref in done:
                try:
                    values[ref] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise RankLaunchError(f"{labels[ref]}: {failed}: {exc}", label=labels[ref],
                                          error=str(exc)) from exc
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return values


def _holding(resource: str, count: float) -> dict[str, Any]:
    """Task options that hold ``count`` of ``resource`` (nothing for CPU: the probe needs only its node)."""
    if resource == "CPU" or not count:
        return {"num_cpus": 0, "num_gpus": 0}
    if resource == "GPU":
        return {"num_cpus": 0, "num_gpus": count}
    return {"num_cpus": 0, "num_gpus": 0, "resources": {resource: count}}


def discover_sites(placement_group: Any, bundle_indices: Sequence[int], *, resource: str, deadline: Deadline,
                   who: Optional[Callable[[int], str]] = None) -> dict[int, BundleSite]:
    """Where each bundle is and every ``resource`` id it holds: one task per bundle holding all of them.

    Ray gives an actor created in a one-accelerator bundle the same id that such
    a task saw; in a bundle of several, the actor gets one of the ids reported.
    ``who`` names a bundle's rank(s) in errors.
    """
    who = who or (lambda index: f"bundle {index}")
    specs = placement_group.bundle_specs
    labels = {
        probe_site_task.options(
            **_holding(resource, specs[index].get(resource, 0)),
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group, placement_group_bundle_index=index),
        ).remote(index, resource): who(index)
        for index in bundle_indices
    }
    found = gather(labels, deadline=deadline, late="placement-group bundle not found",
                   failed="the probe of its placement-group bundle failed",
                   fix="Check that the bundle's node is alive (ray status).")
    return {site.bundle_index: site for site in found.values()}


def resolve_on_nodes(ranks: Sequence[RankOnNode], sites: Mapping[int, BundleSite], server_args: Any, *,
                     policy: Any, deadline: Deadline, gpus: Optional[Sequence[str]] = None,
                     planner: Optional[Planner] = None) -> tuple[NodePlan, ...]:
    """Each node's plan for the ranks whose bundles it holds: one zero-resource task per node, on that node.

    ``policy`` is the engine's ``PlacementPolicy`` (the driver's settings);
    ``planner`` replaces ``plan_node`` there (same keywords), for tests.
    """
    labels = {}
    for node_id, members in by_node(ranks, sites).items():
        request = NodeRequest(server_args=server_args, ranks=members, policy=policy,
                              gpus=tuple(gpus) if gpus is not None else None)
        ref = plan_on_node_task.options(
            num_cpus=0, num_gpus=0, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(request, planner)
        labels[ref] = ", ".join(r.rank.label for r in members)
    plans = gather(labels, deadline=deadline, late="placement not resolved on its node",
                   failed="placement could not be resolved on its node",
                   fix="Check that the node is alive (ray status), or launch with placement off.")
    return tuple(plans[ref] for ref in labels)
