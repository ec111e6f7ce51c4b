"""What runs on a Ray node: the per-rank resolve task and ``SchedulerActor``.

A rank's placement is decided on the node that runs it, for the accelerator Ray
gave it, never from the driver's topology. ``resolve_on_node`` runs as a small
task in the rank's placement-group bundle with the same resources as the actor
(so Ray hands it the same accelerator), resolves the placement there and, for
an ``exec`` placement, returns that node's numactl and Python paths. The driver
then creates ``SchedulerActor`` in the same bundle, started under numactl
through ``runtime_env={"py_executable": ...}`` when the strategy is exec.

Inside, the actor applies the in-process part of its placement (the same
``configure_scheduler_process`` the multiprocessing child uses), then reads its
binding back, every thread included, and compares it with the placement; a rank
that is not where its placement says is reported to the driver, and is an
initialisation error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import ray

from sglang.srt.environ import envs, scoped_environ
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity

logger = logging.getLogger(__name__)

Target = Union[Callable[..., Any], str]

# Only these strategies promise that every thread runs on ``placement.cpus``.
_THREAD_CHECKED_STRATEGIES = ("exec", "in-process")


# --------------------------------------------------------------------------- the resolve task


def accelerator_ids_here(resource: str) -> tuple[str, ...]:
    """The ids of ``resource`` ("GPU") Ray assigned to the calling task or actor; () for CPU-only work."""
    if resource == "CPU":
        return ()
    ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
    return tuple(str(i) for i in ids)


def _default_resolver(server_args: Any, **kwargs: Any) -> ProcessPlacement:
    from sglang.srt.placement.resolve import resolve_rank

    return resolve_rank(server_args, **kwargs)


def resolve_on_node(
    *,
    server_args: Any,
    rank: RankIdentity,
    env: Mapping[str, str],
    accelerator_resource: str,
    exec_supported: bool,
    resolver: Optional[Callable[..., ProcessPlacement]] = None,
) -> dict[str, Any]:
    """Resolve ``rank`` on this node (run as a Ray task in the rank's bundle); a JSON-friendly dict.

    ``exec_argv`` is [numactl, *options, python] for an exec placement whose
    options numactl accepts on this node (the probe resolving it already ran):
    a worker that numactl refuses to start never registers with Ray, and the
    launch would only learn of it at its deadline.
    """
    started = time.perf_counter()
    accelerator_ids = accelerator_ids_here(accelerator_resource)
    with scoped_environ(env):
        placement = (resolver or _default_resolver)(
            server_args,
            dp_rank=rank.dp_rank,
            pp_rank=rank.pp_rank,
            tp_rank=rank.tp_rank,
            gpu_id=rank.gpu_id,
            launcher="ray",
            ray_accelerator_ids=list(accelerator_ids) or None,
            exec_supported=exec_supported,
        )
    exec_argv: Optional[list[str]] = None
    exec_problem: Optional[str] = None
    if placement.strategy == "exec":
        exec_argv, exec_problem = _exec_argv_here(placement)
    return {
        "placement_json": placement.to_json(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "accelerator_ids": list(accelerator_ids),
        "exec_argv": exec_argv,
        "exec_problem": exec_problem,
        "pid": os.getpid(),
        "resolve_s": time.perf_counter() - started,
    }


def _exec_argv_here(placement: ProcessPlacement) -> tuple[Optional[list[str]], Optional[str]]:
    from sglang.srt.placement.numactl import exec_refusal, numactl_prefix

    try:
        prefix = numactl_prefix(placement)
    except FileNotFoundError as exc:
        return None, str(exc)
    complaint = exec_refusal(placement)
    if complaint is not None:
        return None, f"numactl {' '.join(placement.numactl_args)} does not start on this node: {complaint}"
    return [*prefix, sys.executable], None


# --------------------------------------------------------------------------- reading the binding back


def _thread_cpus(tasks_dir: str) -> dict[int, frozenset[int]]:
    found: dict[int, frozenset[int]] = {}
    for name in os.listdir(tasks_dir):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(tasks_dir, name, "status"), encoding="ascii") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited after the listing
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(name)] = parse_cpulist(line.split(":", 1)[1].strip())
                break
    return found


def thread_mismatches(placement: ProcessPlacement, *, tasks_dir: str = "/proc/self/task") -> list[str]:
    """One line when some thread of this process may run outside ``placement.cpus``.

    ``/proc/self/status`` shows the main thread only; a worker that was bound
    from one thread keeps Ray's other threads (and their allocations) unbound.
    """
    if placement.strategy not in _THREAD_CHECKED_STRATEGIES or not placement.cpus:
        return []
    threads = _thread_cpus(tasks_dir)
    off = {tid: cpus for tid, cpus in threads.items() if cpus != placement.cpus}
    if not off:
        return []
    tid, cpus = sorted(off.items())[0]
    return [
        f"{len(off)} of {len(threads)} threads may run outside the planned CPUs "
        f"(thread {tid}: cpus {format_cpulist(cpus) or '(none)'}, planned {format_cpulist(placement.cpus)})"
    ]


def check_binding(
    placement: ProcessPlacement,
    *,
    resolved_node_id: str,
    resolved_accelerator_ids: Sequence[str],
    accelerator_resource: str,
) -> dict[str, Any]:
    """Read this actor's binding back and list every way it differs from ``placement`` (and its premises)."""
    from sglang.srt.placement.observe import compare_binding, observe_self

    mismatches: list[str] = []
    node_id = ray.get_runtime_context().get_node_id()
    if node_id != resolved_node_id:
        mismatches.append(f"placement resolved on Ray node {resolved_node_id}, actor runs on node {node_id}")
    accelerator_ids = accelerator_ids_here(accelerator_resource)
    if tuple(accelerator_ids) != tuple(resolved_accelerator_ids):
        mismatches.append(
            f"placement resolved for {accelerator_resource} {list(resolved_accelerator_ids)}, "
            f"Ray gave this actor {list(accelerator_ids)}"
        )
    observed = observe_self()
    mismatches.extend(compare_binding(placement, observed))
    mismatches.extend(thread_mismatches(placement))
    return {
        "pid": os.getpid(),
        "node_id": node_id,
        "accelerator_ids": list(accelerator_ids),
        "observed": observed.to_dict(),
        "threads": len(os.listdir("/proc/self/task")),
        "mismatches": mismatches,
    }


def _crash_on_bind_failure() -> bool:
    return envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.get()


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

    def __init__(
        self,
        *,
        server_args: Any,
        placement_json: str,
        rank: RankIdentity,
        target: Target,
        resolved_node_id: str,
        resolved_accelerator_ids: Sequence[str] = (),
        accelerator_resource: str = "CPU",
    ) -> None:
        self._rank = rank
        self._scheduler: Any = None
        self._info: dict = {}
        self._binding: dict[str, Any] = {}
        self._error: Optional[dict[str, str]] = None
        try:
            self._start(
                server_args=server_args,
                placement=ProcessPlacement.from_json(placement_json),
                target=_load_target(target),
                resolved_node_id=resolved_node_id,
                resolved_accelerator_ids=resolved_accelerator_ids,
                accelerator_resource=accelerator_resource,
            )
        except BaseException as exc:  # noqa: BLE001 - the driver must hear about every failure, SystemExit included
            tb = traceback.format_exc()
            logger.error(f"{rank.label}: scheduler actor failed to initialise: {exc!r}\n{tb}")
            self._error = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb}

    def _start(
        self,
        *,
        server_args: Any,
        placement: ProcessPlacement,
        target: Callable[..., Any],
        resolved_node_id: str,
        resolved_accelerator_ids: Sequence[str],
        accelerator_resource: str,
    ) -> None:
        from sglang.srt.managers.scheduler import configure_scheduler_rank

        rank = self._rank
        configure_scheduler_rank(server_args, rank=rank, placement=placement)
        self._binding = check_binding(
            placement,
            resolved_node_id=resolved_node_id,
            resolved_accelerator_ids=resolved_accelerator_ids,
            accelerator_resource=accelerator_resource,
        )
        mismatches = self._binding["mismatches"]
        if mismatches:
            message = (
                f"{rank.label}: scheduler actor (pid {os.getpid()}) is not where its placement says "
                f"(strategy {placement.strategy}): {'; '.join(mismatches)}"
            )
            if _crash_on_bind_failure():
                raise PlacementError(
                    f"{message}. SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal; fix the cause, or unset it "
                    f"to run with a warning."
                )
            logger.warning(message)
        self._scheduler = target(server_args=server_args, placement=placement, rank=rank)
        info_fn = getattr(self._scheduler, "ready_info", None)
        info = info_fn() if info_fn is not None else {}
        if not isinstance(info, dict):
            raise TypeError(f"ready_info() returned {type(info).__name__}; it must return a JSON-serialisable dict")
        json.dumps(info)
        self._info = info

    def ready(self) -> dict[str, Any]:
        """Readiness for the driver: ``status`` "ready" with ``info`` and ``binding``, or "error" with the cause."""
        if self._error is not None:
            return {"status": "error", **self._error, "binding": self._binding}
        return {"status": "ready", "info": self._info, "binding": self._binding}

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


resolve_on_node_task = ray.remote(resolve_on_node)
