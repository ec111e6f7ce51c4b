"""What runs on a Ray node for the launcher: the resolve task and the actor's read-back of its binding.

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

import logging
import os
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import ray

from sglang.srt.placement.scoped_environ import scoped_environ
from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy
from sglang.srt.scheduler_launch.common import exec_command, read_back

logger = logging.getLogger(__name__)


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
    if placement.strategy == Strategy.EXEC:
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
    command = exec_command(placement, python=sys.executable)
    if command.argv is None:
        if command.numactl_missing:
            return None, command.refusal
        return None, f"numactl {' '.join(placement.numactl_args)} does not start on this node: {command.refusal}"
    return list(command.argv), None


# --------------------------------------------------------------------------- reading the binding back


def check_binding(
    placement: ProcessPlacement,
    *,
    resolved_node_id: str,
    resolved_accelerator_ids: Sequence[str],
    accelerator_resource: str,
) -> dict[str, Any]:
    """Read this actor's binding back and list every way it differs from ``placement`` (and its premises)."""
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
    return {"node_id": node_id, "accelerator_ids": list(accelerator_ids), **read_back(placement, premises=mismatches)}


resolve_on_node_task = ray.remote(resolve_on_node)
