"""verify --launcher ray: start probe ranks as sglang's RayEngine starts schedulers, and read each binding back.

As ``RayEngine._launch_scheduler_processes`` (sglang 0.5.23) does, verify
reserves one bundle of a node's GPUs per node, puts rank 0 in the bundle on the
driver's node and creates every rank through sglang's own, unmodified
``ray.engine._create_scheduler_actor``, with the per-node GPU index RayEngine
passes (its data-parallel controller does the same for each dp rank in turn).
Only the actor differs: while verify calls it, ``ray.engine``'s
``SchedulerActor`` name is ``ProbeActor``, which takes the same arguments and
runs the same bind as sglang's actor (``bind_scheduler_actor``), then reports
what its process observes instead of loading a model. Everything verify starts
is stopped on every exit, within ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import time
from typing import Any, Iterator, Optional, Sequence

import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.ranks import engine_gpu_id, rank_ranges
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import ProcessPlacement, RankIdentity, TopologyError
from sglang.srt.placement_tools.verify import DEFAULT_TIMEOUT_S, VerifyError, verify_row
from sglang.srt.scheduler_placement.ray_rank import bind_scheduler_actor

logger = logging.getLogger(__name__)

# The last line of a traceback: "package.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception)): (.*)$")


class PlacementProbe:
    """A scheduler rank without a model: built as sglang's ``SchedulerActor`` is, up to
    its ``Scheduler``, then reporting what its process observes."""

    def __init__(
        self,
        server_args: Any,
        port_args: Any,
        gpu_id: int,
        tp_rank: int,
        pp_rank: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str] = None,
    ) -> None:
        # The GPU id sglang's actor uses: Ray's first, else the one passed.
        assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        self._gpu_id = int(assigned[0]) if assigned else gpu_id
        self._assigned = [str(i) for i in assigned]
        self._bound = bind_scheduler_actor(
            server_args,
            gpu_id=self._gpu_id,
            assigned_gpus=assigned,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
        )

    def get_info(self) -> dict:
        from sglang.srt.placement_tools.observe import observe_self

        try:
            launcher_cpus = os.sched_getaffinity(os.getppid())
        except OSError:
            launcher_cpus = os.sched_getaffinity(0)
        placement, outcome = self._bound or (None, None)
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "observed": observe_self().to_dict(),
            "thread_cpus": _thread_cpus(),
            "placement": placement and placement.to_dict(),
            "threads_bound": outcome and outcome.threads,
            "pages_not_migrated": outcome and outcome.pages_not_migrated,
            "node_id": context.get_node_id(),
            "actor": context.get_actor_name(),
            "accelerator_ids": self._assigned,
            "gpu_id": self._gpu_id,
            # What a worker of this node gets when nothing binds it: its raylet's CPUs.
            "unbound_cpus": format_cpulist(launcher_cpus),
        }

    def run_event_loop(self) -> None:
        return None


ProbeActor = ray.remote(PlacementProbe)


def _thread_cpus(tasks_dir: str = "/proc/self/task") -> dict[int, str]:
    """Each thread's CPUs: ``/proc/self/status`` shows the main thread's only."""
    found = {}
    for name in filter(str.isdigit, os.listdir(tasks_dir)):
        try:
            status = os.path.join(tasks_dir, name, "status")
            found[int(name)] = format_cpulist(read_process_affinity(status).cpus)
        except TopologyError:
            continue  # the thread exited after the listing
    return found


class Deadline:
    """One deadline for the whole command."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._at - time.monotonic())

    def text(self) -> str:
        return f"{self.timeout_s:g} s"


@contextlib.contextmanager
def probe_as_scheduler_actor(engine: Any) -> Iterator[None]:
    """Within the block, ``engine._create_scheduler_actor`` creates ``ProbeActor``s:
    its module-global ``SchedulerActor`` name is swapped, and restored after."""
    real = engine.SchedulerActor
    engine.SchedulerActor = ProbeActor
    try:
        yield
    finally:
        engine.SchedulerActor = real


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


def actor_name(rank: RankIdentity, *, pg: Any, bundle_idx: int, rank0_ip: str) -> str:
    """The name sglang's ``_create_scheduler_actor`` gives the actor of ``rank``."""
    return (
        f"sglang_scheduler_node{rank0_ip}_dp{rank.dp_rank}_pp{rank.pp_rank}"
        f"_tp{rank.tp_rank}_pg{pg.id.hex()[:8]}_bundle{bundle_idx}"
    )


def _row(rank: RankIdentity, report: dict, *, expected_actor: str) -> dict:
    on = report.get("placement") is not None
    placement = (
        ProcessPlacement.from_dict(report["placement"])
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
            key: report[key]
            for key in ("accelerator_ids", "threads_bound", "pages_not_migrated")
        }
    )
    row["engine_gpu_id"] = rank.gpu_id
    extra = []
    threads = report["thread_cpus"]
    expected = format_cpulist(placement.cpus) if placement.bound else None
    off = sorted(tid for tid, cpus in threads.items() if cpus != expected)
    if expected is not None and off:
        extra.append(
            f"{len(off)} of {len(threads)} threads run outside the planned CPUs "
            f"(thread {off[0]}: cpus {threads[off[0]] or '(none)'}, planned {expected})"
        )
    if report["actor"] != expected_actor:
        extra.append(
            f"the actor is named {report['actor']!r}, not {expected_actor!r}: it was "
            "not created by sglang's _create_scheduler_actor"
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
    bound itself to.
    """
    import sglang.srt.ray.engine as engine

    deadline = Deadline(timeout_s)
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
    started: list[tuple[RankIdentity, Any, str]] = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=deadline.remaining())
        if not ready:
            raise VerifyError(
                f"the placement group RayEngine reserves ({bundles}, {strategy}) was not ready within "
                f"{deadline.text()}; the cluster has {ray.cluster_resources()}: RayEngine asks one GPU per "
                "rank, for --device cpu too (declare GPUs with `ray start --num-gpus N`)"
            )
        order, rank0_ip = _engine_bundle_order(pg, nnodes)
        with probe_as_scheduler_actor(engine):
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
                name = actor_name(rank, pg=pg, bundle_idx=bundle_idx, rank0_ip=rank0_ip)
                started.append((rank, handle, name))
        reports = _collect(
            [(rank, handle) for rank, handle, _ in started], deadline=deadline
        )
        return [
            _row(rank, report, expected_actor=name)
            for (rank, _, name), report in zip(started, reports)
        ]
    finally:
        for rank, handle, _ in started:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                logger.warning(f"{rank.label}: could not kill its probe actor: {exc}")
        remove_placement_group(pg)
