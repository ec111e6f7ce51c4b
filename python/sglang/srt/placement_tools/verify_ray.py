"""verify --launcher ray: probe ranks started as sglang 0.5.23's RayEngine starts them,
through its own ``_create_scheduler_actor``: sglang's own ``SchedulerActor``, whose
``Scheduler`` alone is the probe (the job's worker set-up hook installs it)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import time
import types
from dataclasses import replace
from typing import Iterator, Sequence

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import PlacementError, RankIdentity
from sglang.srt.placement_tools import PlanArgs
from sglang.srt.placement_tools.engine import from_dict, node_ranks
from sglang.srt.placement_tools.verify import probe_server_args, verify_row

logger = logging.getLogger(__name__)

# The engine's settings, which sglang's actors read where they run: verify hands them
# to its job's workers, as an operator hands them to RayEngine's.
ENGINE_VARS = (
    "SGLANG_NUMA_BIND_V2 SGLANG_AUTO_NUMA_BIND SGLANG_CRASH_ON_NUMA_BIND_FAILURE "
    "SGLANG_SET_CPU_AFFINITY SGLANG_CPU_OMP_THREADS_BIND"
).split()
PROBE_HOOK = "sglang.srt.placement_tools.verify.install_probe_scheduler"
# The last line of a traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception)): (.*)$")


@contextlib.contextmanager
def ray_cluster(server_args: PlanArgs, *, verbose: bool) -> Iterator[None]:
    """The connected Ray cluster, else RAY_ADDRESS's, else a new local one; unless
    ``verbose``, without Ray's notices (such as token authentication's) below errors."""
    if ray.is_initialized():
        yield
        return
    env = settings.device_env(ENGINE_VARS)
    options = dict(configure_logging=False, log_to_driver=False)
    options["runtime_env"] = {"worker_process_setup_hook": PROBE_HOOK}
    if env:
        options["runtime_env"]["env_vars"] = env
    address = os.environ.get("RAY_ADDRESS", "").strip()  # Ray's own convention
    if not address:
        # "local": never join a cluster that someone else's `ray start` recorded on this
        # machine. RayEngine asks one GPU per scheduler actor whatever the device: a CPU
        # engine needs GPUs declared.
        ranks = _gpus(server_args)  # the placement group asks every node's
        options.update(
            num_cpus=max(ranks, len(os.sched_getaffinity(0))),
            num_gpus=ranks if server_args.device == "cpu" else None,
            include_dashboard=False,
        )
    ray_logger = logging.getLogger("ray")  # what `import ray` set: INFO
    level = ray_logger.level
    ray_logger.setLevel(level if verbose else logging.ERROR)
    try:
        ray.init(address=address or "local", **options)
        yield
    finally:
        ray.shutdown()  # nothing to do when init failed
        ray_logger.setLevel(level)


def ray_engine_ranks(
    server_args: PlanArgs, bundle_for_node: Sequence[int]
) -> list[tuple[RankIdentity, int]]:
    """(rank, bundle index) in RayEngine's launch order, with the gpu_id it passes (the
    engine's from 0, step 1, on each node); Ray picks the bundle's GPU it gets."""
    nodes = enumerate(bundle_for_node)
    return [
        (rank, bundle)
        for dp, (node, bundle) in itertools.product(range(server_args.dp_size), nodes)
        for rank in node_ranks(server_args, node, dp, base_gpu_id=0, gpu_id_step=1)
    ]


def _gpus(server_args: PlanArgs) -> int:  # one per scheduler actor, on all nodes
    return server_args.dp_size * server_args.tp_size * server_args.pp_size


def _row(rank: RankIdentity, report: dict, *, expected_actor: str) -> dict:
    if "error" in report:
        raise PlacementError(f"{rank.label}: the probe failed: {report['error']}")
    placement = from_dict(report["placement"])
    placement = replace(placement, rank=replace(rank, device=placement.rank.device))
    unbound = parse_cpulist(report["unbound_cpus"])
    row = verify_row(placement, report, launcher="ray", unbound_cpus=unbound)
    for key in "node_id actor accelerator_ids device_gpu_id".split():
        row[key] = report[key]
    row["engine_gpu_id"] = rank.device.index
    threads = report["thread_cpus"]
    expected = format_cpulist(placement.cpus) if placement.bound else None
    off = sorted(tid for tid, cpus in threads.items() if cpus != expected)
    if expected is not None and off:
        row["differences"].append(
            f"{len(off)} of {len(threads)} threads run outside the planned CPUs "
            f"(thread {off[0]}: cpus {threads[off[0]] or '(none)'}, planned {expected})"
        )
    if report["actor"] != expected_actor:
        row["differences"].append(
            f"the actor is named {report['actor']!r}, not {expected_actor!r}: it was "
            "not created by sglang's _create_scheduler_actor"
        )
    row["ok"] = not row["differences"]
    return row


def _start(
    engine: types.ModuleType,
    server_args: PlanArgs,
    pg: PlacementGroup,
    nnodes: int,
    verbose: bool,
) -> Iterator[tuple[RankIdentity, ray.actor.ActorHandle, str]]:
    """Each rank as upstream's ``_create_scheduler_actor`` creates it, one at a time,
    with the name it gives the actor."""
    # As RayEngine orders the bundles: the driver node's first (rank 0 runs there).
    try:
        first, rank0_ip = engine._find_engine_bundle(pg, nnodes)
    except RuntimeError as exc:
        raise PlacementError(f"{exc} Run verify on a node of the cluster.") from None
    order = [first] + [i for i in range(nnodes) if i != first]
    # The probe makes no process group: any address of rank 0's node will do.
    address = dict(dist_init_addr=f"{rank0_ip}:0", rank0_node_ip=rank0_ip)
    shared = dict(
        pg=pg,
        server_args=probe_server_args(server_args, verbose=verbose),
        port_args=None,
    )
    for rank, bundle in ray_engine_ranks(server_args, order):
        ranks = dict(tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, dp_rank=rank.dp_rank)
        handle = engine._create_scheduler_actor(
            bundle_idx=bundle, gpu_id=rank.device.index, **shared, **address, **ranks
        )
        name = (
            f"sglang_scheduler_node{rank0_ip}_dp{rank.dp_rank}_pp{rank.pp_rank}"
            f"_tp{rank.tp_rank}_pg{pg.id.hex()[:8]}_bundle{bundle}"
        )
        yield rank, handle, name


def _report(
    rank: RankIdentity, ref: ray.ObjectRef, deadline: float, timeout_s: float
) -> dict:
    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(
            f"{rank.label}: no report within {timeout_s:g} s "
            "(see the raylet's worker logs)"
        ) from None
    except ray.exceptions.RayError as exc:
        # What the actor raised: the last "Type: message" line of Ray's text.
        found = [m for m in map(_EXCEPTION_LINE.match, str(exc).splitlines()) if m]
        why = f"{found[-1][1]}: {found[-1][2]}" if found else str(exc)
        raise PlacementError(f"{rank.label}: the probe rank failed: {why}") from exc


def verify_ray(
    server_args: PlanArgs, *, timeout_s: float, verbose: bool = False
) -> list[dict]:
    """One row per rank as RayEngine starts it: observed against what it bound to."""
    import sglang.srt.ray.engine as engine

    deadline = time.monotonic() + timeout_s
    # The placement group RayEngine reserves when it has none.
    nnodes = server_args.nnodes
    bundles = [{"CPU": 1, "GPU": _gpus(server_args) // nnodes}] * nnodes
    strategy = "STRICT_PACK" if nnodes == 1 else "SPREAD"
    pg = placement_group(bundles, strategy=strategy)
    started: list[tuple[RankIdentity, ray.actor.ActorHandle, str]] = []
    try:
        if not ray.wait([pg.ready()], timeout=timeout_s)[0]:
            raise PlacementError(
                f"the placement group RayEngine reserves ({bundles}, {strategy}) was "
                f"not ready within {timeout_s:g} s; the cluster has "
                f"{ray.cluster_resources()}: RayEngine asks one GPU per rank, for "
                "--device cpu too (declare GPUs with `ray start --num-gpus N`)"
            )
        for actor in _start(engine, server_args, pg, nnodes, verbose):
            started.append(actor)  # each killed below, even if a later one fails
        refs = [handle.get_info.remote() for _, handle, _ in started]
        return [
            _row(rank, _report(rank, ref, deadline, timeout_s), expected_actor=name)
            for (rank, _, name), ref in zip(started, refs)
        ]
    finally:
        for rank, handle, _ in started:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                logger.warning(f"{rank.label}: could not kill its probe actor: {exc}")
        remove_placement_group(pg)
