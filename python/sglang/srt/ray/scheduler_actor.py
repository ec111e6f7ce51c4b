"""``SchedulerActor``: one scheduler rank in its own Ray worker process, started under the placement resolved on its node.

Upstream's contract holds: ``SchedulerActor.options(...).remote(server_args=,
port_args=, gpu_id=, tp_rank=, pp_rank=, dp_rank=, dist_init_addr=)`` builds
sglang's ``Scheduler``, and the engine calls ``get_info()`` then
``run_event_loop()``. What changed is where the rank runs: the launcher
resolved its placement on the actor's node before creating it and hands it in
as ``start`` (an ``ActorStart``: one placement per accelerator id Ray may give
the actor; it takes the one of the id it got). An ``exec`` placement started
the worker under numactl; anything else is applied here, in-process, before
the scheduler allocates. Without ``start`` (an older caller), the actor
resolves its own placement on its node, for the GPU Ray gave it, and binds
in-process. Either way it reads its binding back, every thread included: a
rank that is not where its placement says is a warning naming the rank, or an
initialisation error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.

``target`` replaces ``Scheduler`` with any callable
``target(server_args=, placement=, rank=)`` (``verify``'s probe, tests); the
actor then skips what only a model-bearing scheduler needs.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Union

import ray

from sglang.srt.placement.types import ProcessPlacement, RankIdentity

if TYPE_CHECKING:
    from sglang.srt.scheduler_placement.ray_plan import ActorStart

logger = logging.getLogger(__name__)

Target = Union[Callable[..., Any], str]


def _load_target(target: Target) -> Callable[..., Any]:
    if callable(target):
        return target
    module_name, sep, qualname = str(target).partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"scheduler target {target!r} is not valid: give a callable or 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _own_start(server_args: Any, *, rank: RankIdentity, gpu_id: int, resource: str) -> "ActorStart":
    """An actor created without a plan from its node: its placement resolved here, for the device Ray gave
    it (Ray's own id, never re-derived from the engine), bound in-process."""
    from sglang.srt.placement import settings
    from sglang.srt.placement.plan import plan_node
    from sglang.srt.placement.plan_args import placement_view
    from sglang.srt.scheduler_placement.ray_node import accelerator_ids_here
    from sglang.srt.scheduler_placement.ray_plan import ActorStart, demote_to_in_process

    if not settings.bind_v2():
        return ActorStart(rank=rank, accelerator_resource=resource)
    ids = accelerator_ids_here(resource)
    (placement,) = plan_node(placement_view(server_args), ranks_with_ids=[(rank, ids[0] if ids else None)])
    if placement.strategy.value == "exec":
        placement = demote_to_in_process(placement, why="the actor was created without a plan from its node")
    return ActorStart(rank=rank, accelerator_resource=resource, node_id=ray.get_runtime_context().get_node_id(),
                      candidates=((ids[0] if ids else None, placement),))


@ray.remote
class SchedulerActor:
    """One scheduler rank (sglang's ``Scheduler``, or ``target``) in its own Ray worker process."""

    def __init__(
        self,
        server_args: Any,
        port_args: Any,
        gpu_id: int,
        tp_rank: int,
        pp_rank: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str] = None,
        *,
        start: Optional["ActorStart"] = None,
        target: Optional[Target] = None,
    ) -> None:
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._rank = start.rank if start is not None else RankIdentity(
            dp_rank=dp_rank or 0, pp_rank=pp_rank, tp_rank=tp_rank, gpu_id=gpu_id)
        self._binding: dict[str, Any] = {}
        self._placement: Optional[ProcessPlacement] = None
        self._error: Optional[dict[str, str]] = None
        self._info: Optional[dict] = None
        """The target's ready info; None while the actor runs sglang's own scheduler."""
        self.scheduler: Any = None
        if target is None:
            # sglang's own scheduler: a failure raises, as upstream, and the engine kills the actors.
            self._start_scheduler(server_args, port_args, gpu_id=gpu_id, dp_rank=dp_rank,
                                  dist_init_addr=dist_init_addr, start=start)
            return
        try:
            self._start_target(server_args, start=start, target=_load_target(target), gpu_id=gpu_id)
        except BaseException as exc:  # noqa: BLE001 - the launcher must hear about every failure, SystemExit included
            tb = traceback.format_exc()
            logger.error(f"{self._rank.label}: scheduler actor failed to initialise: {exc!r}\n{tb}")
            self._error = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}

    # ----------------------------------------------------------------------- starting

    def _place(self, start: Optional["ActorStart"], *, server_args: Any, gpu_id: int) -> None:
        """Take this actor's placement from ``start``, apply its in-rank part, and read the binding back."""
        from sglang.srt.scheduler_placement.in_rank import apply_in_rank, report_mismatches
        from sglang.srt.scheduler_placement.ray_node import accelerator_ids_here, check_binding
        from sglang.srt.scheduler_placement.ray_plan import actor_placement

        if start is None:
            start = _own_start(server_args, rank=self._rank, gpu_id=gpu_id, resource="GPU")
        accelerator_ids = accelerator_ids_here(start.accelerator_resource)
        placement, premises = actor_placement(start, accelerator_ids, node_id=ray.get_runtime_context().get_node_id())
        self._placement = placement
        if placement is None:
            return
        apply_in_rank(placement, who=self._rank.label)
        self._binding = check_binding(placement, premises=premises, accelerator_ids=accelerator_ids)
        report_mismatches(placement, self._binding, who=self._rank.label, warn=logger.warning)

    def _start_scheduler(self, server_args: Any, port_args: Any, *, gpu_id: int, dp_rank: Optional[int],
                         dist_init_addr: Optional[str], start: Optional["ActorStart"]) -> None:
        from sglang.srt.arg_groups.overrides import declare_resolution
        from sglang.srt.managers.scheduler import Scheduler, configure_scheduler_process, resolve_spawn_dp_rank
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

        if dist_init_addr:
            declare_resolution(server_args, "ray.scheduler_actor", dist_init_addr=dist_init_addr)
        assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if assigned:
            actual_gpu_id = int(assigned[0])
            logger.info(f"[TP{self._tp_rank}] Ray assigned GPU: {actual_gpu_id}")
        else:
            actual_gpu_id = gpu_id
            logger.info(f"[TP{self._tp_rank}] Using passed gpu_id: {gpu_id}")
        dp_rank = resolve_spawn_dp_rank(dp_rank)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(server_args, tp_rank=self._tp_rank, pp_rank=self._pp_rank),
                dp_rank=dp_rank,
                gpu_id=actual_gpu_id,
            ),
        )
        # Title, logging and the legacy V1 bind (SGLANG_NUMA_BIND_V2=0), as for a spawned scheduler.
        configure_scheduler_process(server_args, actual_gpu_id)
        # Before the scheduler allocates anything: what numactl did not apply is applied here.
        self._place(start, server_args=server_args, gpu_id=actual_gpu_id)
        self.scheduler = Scheduler(server_args=server_args, port_args=port_args)

    def _start_target(self, server_args: Any, *, start: Optional["ActorStart"], target: Callable[..., Any],
                      gpu_id: int) -> None:
        self._place(start, server_args=server_args, gpu_id=gpu_id)
        self.scheduler = target(server_args=server_args, placement=self._placement, rank=self._rank)
        ready_info = getattr(self.scheduler, "ready_info", None)
        self._info = ready_info() if ready_info is not None else {}

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"{self._rank.label}: scheduler actor failed to initialise: {self._error['error']}\n"
                f"--- traceback from the actor ---\n{self._error['traceback']}"
            )

    # ----------------------------------------------------------------------- upstream's methods

    def get_info(self) -> Dict[str, Any]:
        """Scheduler initialisation info for the engine's handshake (``target``: its ``ready_info()``)."""
        self._raise_if_failed()
        if self._info is not None:
            return self._info
        return self.scheduler.get_init_info()

    def run_event_loop(self) -> None:
        """Run the scheduler's event loop until it returns (blocks until shutdown)."""
        self._raise_if_failed()
        if self._info is not None:
            loop = getattr(self.scheduler, "event_loop", None)
            if loop is not None:
                loop()
            return
        try:
            import torch

            from sglang.srt.runtime_context import get_device

            # NCCL needs the GPU of this rank set in the thread that runs the loop.
            torch.cuda.set_device(get_device().gpu_id)
            self.scheduler.run_event_loop()
        except Exception as e:
            logger.error(f"Scheduler PP{self._pp_rank} TP{self._tp_rank} crashed: {e}")
            raise

    # ----------------------------------------------------------------------- the launcher's report

    def ready(self) -> dict[str, Any]:
        """Readiness for the launcher: ``status`` "ready" with ``info``, or "error" with the cause; with the
        ``placement`` the actor applied and its ``binding`` read back."""
        if self._error is not None:
            return {"status": "error", **self._error, "binding": self._binding, "placement": self._placement}
        return {"status": "ready", "info": self._info or {}, "binding": self._binding, "placement": self._placement}

    def binding_report(self) -> dict[str, Any]:
        """What the actor read back after applying its placement (pid, observed binding, mismatches)."""
        return self._binding
