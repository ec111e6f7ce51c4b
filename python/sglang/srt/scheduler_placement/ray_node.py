"""What runs on a Ray node while the driver plans a placement group: the bundle probe and the node's plan.

``probe_site`` runs in a bundle holding all of the bundle's GPUs, so Ray hands
it every id an actor in that bundle may get. ``plan_on_node`` runs once per
node with no resources, as soon as its bundles' probes are done (their
results are its arguments): it places every id of the node's bundles
together (``plan_node``: exclusive slices see the whole node), from the ids it
is given (it holds no GPU, and never reads its own ``CUDA_VISIBLE_DEVICES``),
against the node's own topology (its ``SGLANG_SYSFS_ROOT``) under the driver's
policy. For each exec candidate it returns that node's numactl and Python
paths, checked by numactl's own dry run: a worker that numactl refuses to start
never registers with Ray, and the launch would only learn of it at its deadline.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Sequence, Union

import ray

from sglang.srt.placement.types import (
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)
from sglang.srt.scheduler_placement.ray_plan import (
    BundlePlan,
    BundleSite,
    Candidate,
    NodePlan,
    NodeRequest,
    rank_gpu_id,
)

GPU = "GPU"
"""The Ray resource a scheduler actor holds: RayEngine asks one GPU per actor, for every device."""


def accelerator_ids_here() -> tuple[str, ...]:
    """The GPU ids Ray assigned to the calling task or actor."""
    ids = ray.get_runtime_context().get_accelerator_ids().get(GPU, [])
    return tuple(str(i) for i in ids)


def probe_site(bundle_index: int, *after: BundleSite) -> BundleSite:
    """Where this task's bundle is, and the GPU ids it holds (run in the bundle, holding all of them).

    ``after`` is the previous probe's site on the node, there only to make Ray
    run a node's probes one after another.
    """
    context = ray.get_runtime_context()
    return BundleSite(
        bundle_index=bundle_index,
        node_id=context.get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        accelerator_ids=accelerator_ids_here(),
    )


def plan_on_node(request: NodeRequest, *sites: BundleSite) -> NodePlan:
    """One candidate placement per GPU id of each of ``request``'s bundles (run as a Ray task on the node)."""
    from sglang.srt.placement.plan import HostFacts

    started = time.perf_counter()
    node_id = ray.get_runtime_context().get_node_id()
    for site in sites:
        if site.node_id != node_id:
            raise RuntimeError(
                f"bundle {site.bundle_index} is on Ray node {site.node_id}, not on this node "
                f"{node_id} that Ray's placement-group table named"
            )
    site_of = {site.bundle_index: site for site in sites}
    pairs = [
        (index, accelerator_id)
        for index in request.bundles
        for accelerator_id in site_of[index].accelerator_ids
    ]
    planned = plan_ids(
        request.server_args,
        [accelerator_id for _, accelerator_id in pairs],
        policy=request.policy,
        facts=HostFacts.live(),
    )
    where = f"resolved on Ray node {node_id}"
    by_bundle: dict[int, list[Candidate]] = {index: [] for index in request.bundles}
    for (index, accelerator_id), outcome in zip(pairs, planned):
        if isinstance(outcome, str):
            by_bundle[index].append(
                Candidate(accelerator_id=accelerator_id, placement=None, error=outcome)
            )
            continue
        placement = outcome.replace(reasons=(*outcome.reasons, where))
        argv, problem = _exec_argv_here(placement)
        by_bundle[index].append(
            Candidate(
                accelerator_id=accelerator_id,
                placement=placement,
                exec_argv=argv,
                exec_problem=problem,
            )
        )
    return NodePlan(
        node_id=node_id,
        node_ip=ray.util.get_node_ip_address(),
        sites=tuple(site_of[index] for index in request.bundles),
        bundles=tuple(
            BundlePlan(bundle_index=index, candidates=tuple(by_bundle[index]))
            for index in request.bundles
            if by_bundle[index]
        ),
        resolve_s=time.perf_counter() - started,
    )


def plan_ids(
    server_args: Any,
    accelerator_ids: Sequence[str],
    *,
    policy: Any,
    facts: Any,
) -> list[Union[ProcessPlacement, str]]:
    """A placement per Ray GPU id of one node, all placed together, or the error that id's rank would meet.

    A setting that does not fit one id (a ``--numa-node`` list too short for
    it, an ``SGLANG_CPU_OMP_THREADS_BIND`` without a group for it) fails only the
    ranks that get that id; the other ids are still placed together.
    """
    from sglang.srt.placement.plan import plan_node

    found: list[Union[tuple[RankIdentity, str], str]] = []
    for accelerator_id in accelerator_ids:
        gpu_id, problem = rank_gpu_id(accelerator_id)
        if problem is not None:
            found.append(problem)
        else:
            found.append(
                (
                    RankIdentity(
                        dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=gpu_id
                    ),  # a stand-in
                    accelerator_id,
                )
            )

    def place(pairs: list[tuple[RankIdentity, str]]) -> Sequence[ProcessPlacement]:
        return plan_node(server_args, ranks_with_ids=pairs, policy=policy, facts=facts)

    good = [item for item in found if not isinstance(item, str)]
    try:
        placed = place(good) if good else ()
    except (ValueError, PlacementError):
        # Find the ids the setting does not fit, then place the others together again.
        for i, item in enumerate(found):
            if isinstance(item, str):
                continue
            try:
                place([item])
            except (ValueError, PlacementError) as exc:
                found[i] = _unlabelled(str(exc))
        good = [item for item in found if not isinstance(item, str)]
        placed = place(good) if good else ()
    rest = iter(placed)
    return [item if isinstance(item, str) else next(rest) for item in found]


_STAND_IN = RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=None).label


def _unlabelled(text: str) -> str:
    """``text`` without the stand-in rank's label: a node plans ids, not ranks (the actor adds its own)."""
    return text.replace(f"{_STAND_IN}: ", "").replace(_STAND_IN, "the rank")


def _exec_argv_here(
    placement: ProcessPlacement,
) -> tuple[Optional[tuple[str, ...]], Optional[str]]:
    """[numactl, *options, python] that starts an exec ``placement`` here, or why there is none."""
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
            f"numactl {' '.join(placement.numactl_args)} does not start on this node: {complaint}"
        )
    return (*prefix, sys.executable), None


probe_site_task = ray.remote(probe_site)
plan_on_node_task = ray.remote(plan_on_node)
