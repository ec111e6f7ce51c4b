"""The placement settings operators give as env vars, each read here; what upstream's
``EnvStr`` fields hand over unchecked is validated."""

from __future__ import annotations

from sglang.srt.environ import envs
from sglang.srt.placement.types import AFFINITY_MODES


class SettingError(ValueError):
    """A setting placement cannot use: names it, the value and the fix."""


def bind_v2() -> bool:
    return bool(envs.SGLANG_NUMA_BIND_V2.get())  # False: the legacy in-child bind


def auto_numa_bind() -> bool:
    return bool(envs.SGLANG_AUTO_NUMA_BIND.get())


def bind_failure_is_fatal() -> bool:
    return bool(envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.get())


def one_visible_device_per_process() -> bool:
    return bool(envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get())


def affinity_mode() -> str:
    value = str(envs.SGLANG_NUMA_AFFINITY_MODE.get()).strip()
    if value not in AFFINITY_MODES:
        raise SettingError(
            f"SGLANG_NUMA_AFFINITY_MODE={value!r} is not valid: choose one of "
            f"{', '.join(AFFINITY_MODES)}"
        )
    return value


def cpu_threads_bind() -> str:
    value = str(envs.SGLANG_CPU_OMP_THREADS_BIND.get()).strip()
    if not value:
        raise SettingError(
            "SGLANG_CPU_OMP_THREADS_BIND is empty: set it to 'all' or to one cpulist "
            "per rank, e.g. 0-31|32-63"
        )
    return value


def sysfs_root() -> str:
    value = str(envs.SGLANG_SYSFS_ROOT.get())
    if not value or "\0" in value:
        raise SettingError(
            f"SGLANG_SYSFS_ROOT={value!r} is not valid: give a directory such as /sys "
            "or a capture snapshot"
        )
    return value


# The engine's settings, read where each rank runs: ``verify`` hands the driver's
# values to its Ray job's workers.
ENGINE_POLICY_VARS = (
    "SGLANG_NUMA_BIND_V2",
    "SGLANG_AUTO_NUMA_BIND",
    "SGLANG_CRASH_ON_NUMA_BIND_FAILURE",
    "SGLANG_NUMA_AFFINITY_MODE",
    "SGLANG_CPU_OMP_THREADS_BIND",
)
