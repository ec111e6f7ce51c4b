"""``SchedulerActor``: one scheduler rank in its own Ray worker process, started under its placement.

The placement was resolved on the actor's node before the actor was created
and arrives in an ``ActorStart`` (one placement per accelerator id Ray may give
it: the actor takes the one of the id it got); an ``exec`` placement started
the worker under numactl. Inside, the actor applies the in-process part of its placement,
reads its binding back (every thread included) and compares it with the
placement: a rank that is not where its placement says is reported, and is an
initialisation error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import ray

from sglang.srt.placement.types import ProcessPlacement

if TYPE_CHECKING:
    from sglang.srt.scheduler_launch.ray_plan import ActorStart

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


# --------------------------------------------------------------------------- the actor


@ray.remote
class SchedulerActor:
    """One scheduler rank in its own Ray worker process.

    Initialisation never raises: a failure is kept and reported by ``ready()``
    with its traceback, so the driver can name the rank and the cause, then
    kill the actor.
    """

    def __init__(self, *, server_args: Any, start: "ActorStart", target: Target) -> None:
        self._rank = start.rank
        self._scheduler: Any = None
        self._info: dict = {}
        self._binding: dict[str, Any] = {}
        self._placement: Optional[ProcessPlacement] = None
        self._error: Optional[dict[str, str]] = None
        try:
            self._start(server_args=server_args, start=start, target=_load_target(target))
        except BaseException as exc:  # noqa: BLE001 - the driver must hear about every failure, SystemExit included
            tb = traceback.format_exc()
            logger.error(f"{start.rank.label}: scheduler actor failed to initialise: {exc!r}\n{tb}")
            self._error = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}

    def _start(self, *, server_args: Any, start: "ActorStart", target: Callable[..., Any]) -> None:
        from sglang.srt.scheduler_launch.child import configure_scheduler_rank
        from sglang.srt.scheduler_launch.common import ready_info_of, report_mismatches
        from sglang.srt.scheduler_launch.ray_node import accelerator_ids_here, check_binding
        from sglang.srt.scheduler_launch.ray_plan import actor_placement

        rank = self._rank
        # Only now is the accelerator known: with several candidates, it picks the placement.
        accelerator_ids = accelerator_ids_here(start.accelerator_resource)
        placement, premises = actor_placement(start, accelerator_ids,
                                              node_id=ray.get_runtime_context().get_node_id())
        self._placement = placement
        configure_scheduler_rank(server_args, rank=rank, placement=placement)
        if placement is not None:
            self._binding = check_binding(placement, premises=premises, accelerator_ids=accelerator_ids)
            report_mismatches(placement, self._binding, who=rank.label, warn=logger.warning)
        self._scheduler = target(server_args=server_args, placement=placement, rank=rank)
        info = ready_info_of(self._scheduler)
        self._info = info

    def ready(self) -> dict[str, Any]:
        """Readiness for the driver: ``status`` "ready" with ``info``, or "error" with the cause; with the
        ``placement`` the actor applied and its ``binding`` read back."""
        if self._error is not None:
            return {"status": "error", **self._error, "binding": self._binding, "placement": self._placement}
        return {"status": "ready", "info": self._info, "binding": self._binding, "placement": self._placement}

    def ready_info(self) -> dict:
        """The target's ``ready_info()`` (launcher protocol)."""
        if self._error is not None:
            raise RuntimeError(f"{self._rank.label}: scheduler actor failed to initialise: {self._error['error']}")
        return self._info

    def binding_report(self) -> dict[str, Any]:
        """What the actor read back after applying its placement (pid, observed binding, mismatches)."""
        return self._binding

    def event_loop(self) -> None:
        """Run the target's event loop, if it has one, until it returns."""
        if self._error is not None:
            raise RuntimeError(f"{self._rank.label}: scheduler actor failed to initialise: {self._error['error']}")
        loop = getattr(self._scheduler, "event_loop", None)
        if loop is not None:
            loop()


