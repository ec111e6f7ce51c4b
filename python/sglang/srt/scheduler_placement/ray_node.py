"""What runs on a Ray node for the launcher: the bundle probe, the node's plan for its ranks, and the actor's read-back.

``probe_site`` runs in a bundle holding all of the bundle's accelerators, so
Ray hands it every id an actor in that bundle may get. ``plan_on_node`` runs
once per node with no resources, as soon as its bundles' probes are done (their
results are its arguments): it resolves all of the node's ranks together
from the ids it is given (it holds no GPU, and never reads its own
``CUDA_VISIBLE_DEVICES``), against the node's own topology (its
``SGLANG_SYSFS_ROOT``) under the driver's policy, and for each exec candidate
returns that node's numactl and Python paths, checked by numactl's own dry
run: a worker that numactl refuses to start never registers with Ray, and the
launch would only learn of it at its deadline.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import ray

from sglang.srt.placement.types import ProcessPlacement, Strategy
from sglang.srt.scheduler_placement.in_rank import read_back
from sglang.srt.scheduler_placement.ray_plan import exec_command
from sglang.srt.scheduler_placement.ray_plan import BundleSite, Candidate, NodePlan, NodeRequest, RankPlan, ranks_on_sites

Planner = Callable[..., Sequence[ProcessPlacement]]
"""``plan_node``'s signature: (server_args, *, ranks_with_ids, policy, gpus) -> one placement per pair."""


def accelerator_ids_here(resource: str) -> tuple[str, ...]:
    """The ids of ``resource`` ("GPU") Ray assigned to the calling task or actor; () for CPU-only work."""
    if resource == "CPU":
        return ()
    ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
    return tuple(str(i) for i in ids)


def probe_site(bundle_index: int, resource: str, *after: BundleSite) -> BundleSite:
    """Where this task's bundle is, and the ids of ``resource`` it holds (run in the bundle, holding all of them).

    ``after`` is the previous probe's site, only there to make Ray run the probes one after another.
    """
    context = ray.get_runtime_context()
    return BundleSite(bundle_index=bundle_index, node_id=context.get_node_id(),
                      node_ip=ray.util.get_node_ip_address(), accelerator_ids=accelerator_ids_here(resource))


def _default_planner(server_args: Any, **kwargs: Any) -> Sequence[ProcessPlacement]:
    from sglang.srt.placement.plan import plan_node

    return plan_node(server_args, **kwargs)


def plan_on_node(request: NodeRequest, planner: Optional[Planner], *sites: BundleSite) -> NodePlan:
    """Resolve every rank of ``request`` on this node, one placement per candidate id (run as a Ray task).

    ``sites`` are this node's bundles as their probes found them (passed as task
    arguments, so Ray starts this task once they are known); a bundle without
    one (a CPU bundle holds no accelerator) is this node with no ids.
    """
    started = time.perf_counter()
    node_id = ray.get_runtime_context().get_node_id()
    node_ip = ray.util.get_node_ip_address()
    found = {site.bundle_index: site for site in sites}
    for site in sites:
        if site.node_id != node_id:
            raise RuntimeError(f"bundle {site.bundle_index} is on Ray node {site.node_id}, not on this node "
                               f"{node_id} that Ray's placement-group table named")
    bundles = sorted({index for _, index in request.ranks})
    site_of = {i: found.get(i) or BundleSite(bundle_index=i, node_id=node_id, node_ip=node_ip) for i in bundles}
    on_node = ranks_on_sites(request.ranks, site_of)
    pairs = [(r.rank, candidate) for r in on_node for candidate in (r.accelerator_ids or (None,))]
    placements = list((planner or _default_planner)(
        request.server_args, ranks_with_ids=pairs, policy=request.policy, gpus=request.gpus))
    if len(placements) != len(pairs):
        raise ValueError(f"the planner returned {len(placements)} placements for {len(pairs)} (rank, id) pairs")
    where = f"resolved on Ray node {node_id}"
    ranks: list[RankPlan] = []
    for r in on_node:
        candidates = []
        for candidate in r.accelerator_ids or (None,):
            placement = placements.pop(0)
            placement = placement.replace(reasons=(*placement.reasons, where))
            argv, problem = _exec_argv_here(placement)
            candidates.append(Candidate(accelerator_id=candidate, placement=placement, exec_argv=argv,
                                        exec_problem=problem))
        ranks.append(RankPlan(rank=r.rank, bundle_index=r.bundle_index, candidates=tuple(candidates)))
    return NodePlan(node_id=node_id, node_ip=node_ip, sites=tuple(site_of[i] for i in bundles), ranks=tuple(ranks),
                    resolve_s=time.perf_counter() - started, pid=os.getpid())


def _exec_argv_here(placement: ProcessPlacement) -> tuple[Optional[tuple[str, ...]], Optional[str]]:
    if placement.strategy != Strategy.EXEC:
        return None, None
    command = exec_command(placement, python=sys.executable)
    if command.argv is None:
        if command.numactl_missing:
            return None, command.refusal
        return None, f"numactl {' '.join(placement.numactl_args)} does not start on this node: {command.refusal}"
    return command.argv, None


def check_binding(placement: ProcessPlacement, *, premises: Sequence[str], accelerator_ids: Sequence[str]) -> dict:
    """Read this actor's binding back and list every way it differs from ``placement`` (premises first)."""
    node_id = ray.get_runtime_context().get_node_id()
    return {"node_id": node_id, "accelerator_ids": list(accelerator_ids), **read_back(placement, premises=premises)}


probe_site_task = ray.remote(probe_site)
plan_on_node_task = ray.remote(plan_on_node)
