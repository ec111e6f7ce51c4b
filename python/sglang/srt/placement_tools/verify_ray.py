"""verify --launcher ray: start probe ranks as sglang's RayEngine starts schedulers, and read each binding back.

As ``RayEngine._launch_scheduler_processes`` (sglang 0.5.23) does, verify
reserves one bundle of a node's GPUs per node, puts rank 0 in the bundle on the
driver's node and creates every rank through the overlaid
``_create_scheduler_actor``, with the per-node GPU index RayEngine passes (its
data-parallel controller does the same for each dp rank in turn). Only the
actor differs: ``PlacementProbe`` is placed as sglang's ``SchedulerActor`` is
(``SchedulerRank``), then reports what its process observes instead of loading
a model. Everything verify starts is stopped on every exit, within ``timeout_s``.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from typing import Any, Sequence

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.ranks import engine_gpu_id, rank_ranges
from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.placement_tools.verify import DEFAULT_TIMEOUT_S, VerifyError, verify_row
from sglang.srt.scheduler_placement.ray_rank import SchedulerRank

logger = logging.getLogger(__name__)

# The last line of a traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception)): (.*)$")


class PlacementProbe(SchedulerRank):
    """A scheduler rank without a model: placed as a real one, then reporting what its process observes."""

    def get_info(self) -> dict:
        from sglang.srt.placement_tools.observe import observe_self

        try:
            launcher_cpus = os.sched_getaffinity(os.getppid())
        except OSError:
            launcher_cpus = os.sched_getaffinity(0)
        context = ray.get_runtime_context()
        return {
            "observed": observe_self().to_dict(),
            "binding": self.binding_report(),
            "node_id": context.get_node_id(),
            "actor": context.get_actor_name(),
            "gpu_id": self._rank.gpu_id,
            # What a worker of this node gets when nothing binds it: its raylet's CPUs.
            "unbound_cpus": format_cpulist(launcher_cpus),
        }

    def run_event_loop(self) -> None:
        return None


ProbeActor = ray.remote(PlacementProbe)


def ray_engine_ranks(
    server_args: Any, bundle_for_node: Sequence[int]
) -> list[tuple[RankIdentity, int]]:
    """(rank with the gpu_id RayEngine passes, bundle index) for every rank, in
    RayEngine's launch order: one dp rank after another (its data-parallel
    controller's), each with the same per-node GPU indices (Ray picks which GPU of the
    bundle each actor gets)."""
    tp, pp, nnodes = server_args.tp_size, server_args.pp_size, server_args.nnodes
    out = []
    for dp_rank in range(server_args.dp_size):
        for node_idx, bundle_idx in enumerate(bundle_for_node):
            r = rank_ranges(tp_size=tp, pp_size=pp, nnodes=nnodes, node_rank=node_idx)
            for pp_rank, tp_rank in itertools.product(r.pp_ranks, r.tp_ranks):
                # RayEngine's per-node GPU index: the engine's formula from 0, step 1.
                gpu_id = engine_gpu_id(
                    base_gpu_id=0,
                    gpu_id_step=1,
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    ranges=r,
                )
                rank = RankIdentity(
                    dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id
                )
                out.append((rank, bundle_idx))
    return out


def _engine_bundle_order(pg: Any, nnodes: int) -> tuple[list[int], str]:
    """RayEngine's ``_find_engine_bundle``: the bundle on the driver's node first,
    then the others (each bundle's node address read from Ray's tables, where
    RayEngine asks a task in the bundle).
    """
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    address = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    bundle_ips = [address.get(node_of[i]) for i in range(nnodes)]
    engine_ip = ray.util.get_node_ip_address()
    if engine_ip not in bundle_ips:
        raise VerifyError(
            f"Engine node {engine_ip} not found in any placement group bundle {bundle_ips}. "
            f"Rank-0 scheduler must be co-located with the Engine: run verify on a node of the cluster"
        )
    engine_bundle = bundle_ips.index(engine_ip)
    order = [engine_bundle] + [i for i in range(nnodes) if i != engine_bundle]
    return order, engine_ip


def _row(rank: RankIdentity, report: dict) -> dict:
    binding = report.get("binding") or {}
    on = binding.get("placement") is not None
    placement = (
        ProcessPlacement.from_dict(binding["placement"])
        if on
        else ProcessPlacement.unbound(
            rank,
            reasons=[
                "SGLANG_NUMA_BIND_V2=0: the legacy bind runs in sglang's "
                "configure_scheduler_process, which the probe does not run"
            ],
            launcher="ray",
            failure=False,
        )
    )
    unbound = parse_cpulist(report["unbound_cpus"])
    row = verify_row(placement, report, launcher="ray", unbound_cpus=unbound)
    row.update(
        {
            "engine_gpu_id": rank.gpu_id,
            "accelerator_ids": binding.get("accelerator_ids", []),
            "planned_on": binding.get("planned_on"),
            "actor_mismatches": binding.get("mismatches", []),
        }
    )
    extra = [f"the actor's own read-back: {m}" for m in row["actor_mismatches"]]
    if on and row["planned_on"] is None:
        extra.append(
            "the rank was not started with a plan from its node (sglang's _create_scheduler_actor "
            "plans every rank there): " + "; ".join(placement.reasons[:1])
        )
    if extra:
        row["differences"] = [*row["differences"], *extra]
        row["ok"] = False
    return row


def _cause(exc: BaseException) -> str:
    """What a probe's actor raised, from Ray's error text (its last ``Type: message`` line)."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        found = _EXCEPTION_LINE.match(line)
        if found:
            return f"{found.group(1)}: {found.group(2)}"
    return text


def _collect(
    started: Sequence[tuple[RankIdentity, Any]], *, deadline: Any
) -> list[dict]:
    refs = {handle.get_info.remote(): i for i, (_, handle) in enumerate(started)}
    reports: dict[int, dict] = {}
    while len(reports) < len(started):
        pending = [ref for ref, i in refs.items() if i not in reports]
        if not deadline.remaining():
            who = ", ".join(started[refs[ref]][0].label for ref in pending)
            raise VerifyError(
                f"{who}: no report within {deadline.text()} (see the raylet's worker logs)"
            )
        done, _ = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
        for ref in done:
            rank = started[refs[ref]][0]
            try:
                reports[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise VerifyError(
                    f"{rank.label}: the probe rank failed: {_cause(exc)}"
                ) from exc
    return [reports[i] for i in range(len(started))]


def verify_ray(server_args: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """One row per rank of the engine, each started as RayEngine starts it on the
    connected Ray cluster, comparing what the rank observes with the placement it
    applied (and whether its node planned it).
    """
    import sglang.srt.ray.engine as engine
    from sglang.srt.placement import settings
    from sglang.srt.placement.policy import PlacementPolicy, placement_view
    from sglang.srt.scheduler_placement import ray_actors

    deadline = ray_actors.Deadline(timeout_s)
    # The placement group RayEngine reserves when it has none.
    total_gpus = server_args.dp_size * server_args.tp_size * server_args.pp_size
    nnodes = server_args.nnodes
    if total_gpus % nnodes:
        raise ValueError(
            f"--dp-size x --tp-size x --pp-size = {total_gpus} GPUs cannot be split "
            f"evenly over --nnodes={nnodes}: RayEngine reserves the same number of "
            "GPUs on every node"
        )
    bundles = [{"CPU": 1, "GPU": total_gpus // nnodes}] * nnodes
    strategy = "STRICT_PACK" if nnodes == 1 else "SPREAD"
    pg = placement_group(bundles, strategy=strategy)
    started: list[tuple[RankIdentity, Any]] = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=deadline.remaining())
        if not ready:
            raise VerifyError(
                f"the placement group RayEngine reserves ({bundles}, {strategy}) was not ready within "
                f"{deadline.text()}; the cluster has {ray.cluster_resources()}: RayEngine asks one GPU per "
                "rank, for --device cpu too (declare GPUs with `ray start --num-gpus N`)"
            )
        order, rank0_ip = _engine_bundle_order(pg, nnodes)
        if settings.bind_v2():
            # Planned here under verify's deadline; the actors' calls then find the plan kept.
            policy = PlacementPolicy.from_env(
                placement_view(server_args), launcher="ray"
            )
            plan = ray_actors.group_plan(
                pg, server_args, policy=policy, deadline=deadline
            )
            if plan is None:
                raise VerifyError(
                    "the placement group could not be planned on its nodes (see above)"
                )
        with ray_actors.scheduler_actor_class(ProbeActor):
            for rank, bundle_idx in ray_engine_ranks(server_args, order):
                handle = engine._create_scheduler_actor(
                    pg=pg,
                    bundle_idx=bundle_idx,
                    gpu_id=rank.gpu_id,
                    server_args=server_args,
                    port_args=None,
                    tp_rank=rank.tp_rank,
                    pp_rank=rank.pp_rank,
                    dp_rank=rank.dp_rank,
                    # The probe builds no process group: any address of rank 0's node will do.
                    dist_init_addr=f"{rank0_ip}:0",
                    rank0_node_ip=rank0_ip,
                )
                started.append((rank, handle))
        reports = _collect(started, deadline=deadline)
        return [_row(rank, report) for (rank, _), report in zip(started, reports)]
    finally:
        for rank, handle in started:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                logger.warning(f"{rank.label}: could not kill its probe actor: {exc}")
        remove_placement_group(pg)
        ray_actors.forget_group(pg)
