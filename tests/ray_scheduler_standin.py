"""sglang's ``Scheduler`` stood in, inside Ray workers: a job's ``worker_process_setup_hook``.

``install`` puts a module in ``sys.modules`` under ``sglang.srt.managers.scheduler``
holding the names ``SchedulerActor`` takes from it: ``configure_scheduler_process`` and
``resolve_spawn_dp_rank`` are sglang's own functions, compiled from the installed
package's ``scheduler.py`` with their globals bound by that file's own imports
(``ray_upstream``); ``Scheduler`` is the stand-in, which loads no model and reports,
from inside the actor once ``configure_scheduler_process`` has run, where the actor's
process runs. Importing the real module would build sglang's whole model stack: about
20 s of CPU per actor here, on top of the 17 s an actor costs without it.

The report (``Scheduler.get_init_info``, which ``SchedulerActor.get_info`` returns):
every thread's CPUs, the memory policy, the ``gpu_id`` the actor published
(``runtime_context.get_device``), Ray's GPU ids, ``CUDA_VISIBLE_DEVICES`` and the CUDA
device count the actor sees, the OpenMP CPUs bootstrap would give a CPU-device rank,
the lines ``sglang.srt.utils.numa_utils`` logged (the placement), and the files the
actor's code and sglang came from.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

from ray_upstream import functions_from_source

STUBBED = "sglang.srt.managers.scheduler"
REAL_FUNCTIONS = ("configure_scheduler_process", "resolve_spawn_dp_rank")
PLACEMENT_LOGGER = "sglang.srt.utils.numa_utils"
_MEMPOLICY_MODES = {
    0: "default",
    1: "preferred",
    2: "bind",
    3: "interleave",
    4: "local",
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


_PLACEMENT_LINES = _Lines()


def _mempolicy() -> tuple[str, list[int]]:
    """The calling thread's memory policy and its nodes (get_mempolicy(2))."""
    libnuma = ctypes.CDLL("libnuma.so.1", use_errno=True)
    mode = ctypes.c_int()
    words = 16
    mask = (ctypes.c_ulong * words)()
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    if libnuma.get_mempolicy(
        ctypes.byref(mode), mask, ctypes.c_ulong(words * bits), None, ctypes.c_ulong(0)
    ):
        raise OSError(ctypes.get_errno(), "get_mempolicy failed")
    nodes = [n for n in range(words * bits) if mask[n // bits] >> (n % bits) & 1]
    return _MEMPOLICY_MODES.get(mode.value, str(mode.value)), nodes


def _thread_cpus() -> dict[str, list[int]]:
    cpus = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus[tid] = sorted(os.sched_getaffinity(int(tid)))
        except (ProcessLookupError, FileNotFoundError):  # it exited meanwhile
            pass
    return cpus


def _omp_cpus(server_args: Any) -> Any:
    """What bootstrap's ``_bind_threads_if_cpu`` gives this rank's OpenMP threads
    (``init_threads_binding`` by the published gpu_id); None off the CPU device."""
    if server_args.device != "cpu":
        return None
    from sglang.srt.distributed import bootstrap

    try:
        return bootstrap._bind_threads_if_cpu(device="cpu")
    except Exception as exc:  # reported: the test judges it
        return f"{type(exc).__name__}: {exc}"


class Scheduler:
    """Built where sglang builds its Scheduler; records the actor's process."""

    def __init__(self, server_args: Any, port_args: Any = None) -> None:
        import ray
        import torch

        from sglang.srt.runtime_context import get_device
        from sglang.srt.utils import numa_utils

        caller = sys._getframe(1).f_code
        policy, policy_nodes = _mempolicy()
        self.info = {
            "pid": os.getpid(),
            "cpu_s": sum(os.times()[:2]),
            "thread_cpus": _thread_cpus(),
            "mempolicy": [policy, policy_nodes],
            "published_gpu_id": get_device().gpu_id,
            "ray_gpu_ids": [
                int(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]
            ],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_count": torch.cuda.device_count(),
            "omp_cpus": _omp_cpus(server_args),
            "placement_log": list(_PLACEMENT_LINES.lines),
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "built_by": f"{caller.co_filename}:{caller.co_name}",
            "numa_utils": numa_utils.__file__,
            "configure_scheduler_process": sys.modules[
                STUBBED
            ].configure_scheduler_process.__code__.co_filename,
        }

    def get_init_info(self) -> dict:
        return self.info

    def run_event_loop(self) -> None:
        return None


def install() -> None:
    """The job's ``worker_process_setup_hook``: runs in each of its Ray workers."""
    logging.getLogger(PLACEMENT_LOGGER).addHandler(_PLACEMENT_LINES)
    module = functions_from_source(STUBBED, REAL_FUNCTIONS)
    module.Scheduler = Scheduler
    sys.modules[STUBBED] = module
