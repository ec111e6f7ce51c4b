"""Every environment variable placement reads, each read here once; what upstream's
``EnvStr`` fields hand over unchecked is validated."""

from __future__ import annotations

import os

from sglang.srt.environ import envs
from sglang.srt.placement.modes import AffinityMode
from sglang.srt.placement.types import SettingError

__all__ = ["SettingError"]

# Which physical device a logical index names, and in which order: read as the rank's
# own environment, which a launcher may change for the child (one visible device).
DEVICE_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "ZE_AFFINITY_MASK",
    "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
)


VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


def bind_v2() -> bool:
    return bool(envs.SGLANG_NUMA_BIND_V2.get())  # False: the legacy in-child bind


def auto_numa_bind() -> bool:
    return bool(envs.SGLANG_AUTO_NUMA_BIND.get())


def bind_failure_is_fatal() -> bool:
    return bool(envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.get())


def one_visible_device_per_process() -> bool:
    return bool(envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get())


def affinity_mode() -> AffinityMode:
    value = envs.SGLANG_NUMA_AFFINITY_MODE.get()
    return AffinityMode.parse(value, setting="SGLANG_NUMA_AFFINITY_MODE")


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


def device_env() -> dict[str, str]:
    """This process's device-visibility variables (those set)."""
    return {name: os.environ[name] for name in DEVICE_VARS if name in os.environ}
