"""A stand-in for sglang's model-bearing ``Scheduler``, installed in Ray workers by a job's setup hook.

``install`` replaces ``sglang.srt.managers.scheduler`` (whose import builds the
whole model stack) with a module of the three names ``SchedulerActor`` takes
from it, and ``runtime_context.publish`` (which reads the model's config) with
a no-op. The stand-in scheduler records where it runs, so a test can check the
placement an upstream-created actor was started under.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Optional

from sglang.srt.placement.libnuma import read_mempolicy
from sglang.srt.placement_tools.verify import ProbeScheduler

CONFIGURED: dict[str, Any] = {}


class Scheduler(ProbeScheduler):
    """verify's probe Scheduler (what it observes, the placement the actor applied), and
    a few facts of the rank's process for the tests."""

    def __init__(self, *, server_args: Any, port_args: Any) -> None:
        import torch

        super().__init__(server_args, port_args)
        torch.cuda.set_device = (
            lambda device: None
        )  # this host has no CUDA device; the event loop sets one

        policy, nodes = read_mempolicy()
        self.info.update(
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cpus=sorted(os.sched_getaffinity(0)),
            thread_cpu_sets=sorted(
                {
                    tuple(os.sched_getaffinity(int(tid)))
                    for tid in os.listdir("/proc/self/task")
                }
            ),
            policy=policy,
            policy_nodes=sorted(nodes),
            configured_gpu_id=CONFIGURED.get("gpu_id"),
            model_path=server_args.model_path,
            omp_bind_env=os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"),
        )


def configure_scheduler_process(
    server_args: Any, gpu_id: int, *args: Any, **kwargs: Any
) -> None:
    from sglang.srt.utils.numa_utils import bind_scheduler_process

    CONFIGURED["gpu_id"] = gpu_id
    # The part of configure_scheduler_process (as the overlay rewrites it) that places
    # the process.
    bind_scheduler_process(server_args, gpu_id)


def resolve_spawn_dp_rank(dp_rank: Optional[int]) -> Optional[int]:
    return dp_rank


def _not_in_the_stand_in(name: str) -> Any:
    # Other upstream modules import more names from the scheduler module at load time (the engine, the
    # data-parallel controller); the actor never calls them.
    if name.startswith("__"):
        raise AttributeError(name)

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"sglang.srt.managers.scheduler.{name} is not part of the test's stand-in"
        )

    return absent


def install() -> None:
    module = types.ModuleType("sglang.srt.managers.scheduler")
    module.__getattr__ = _not_in_the_stand_in
    module.Scheduler = Scheduler
    module.configure_scheduler_process = configure_scheduler_process
    module.resolve_spawn_dp_rank = resolve_spawn_dp_rank
    sys.modules["sglang.srt.managers.scheduler"] = module
    # Publishing resolves the server args against the model's config: model-bearing too.
    import sglang.srt.runtime_context as runtime_context

    runtime_context.publish = lambda *args, **kwargs: None
    runtime_context.get_device = lambda: types.SimpleNamespace(
        gpu_id=int(os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    )
