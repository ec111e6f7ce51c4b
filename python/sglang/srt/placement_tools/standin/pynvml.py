"""A stand-in for NVIDIA's ``pynvml``, first on the path where ``plan`` plans a host
that is not this one: the GPUs that ``PLACEMENT_TOOLS_GPUS`` lists (PCI addresses in
NVML's order; a container's own GPUs only), each with the memory affinity NVML reads,
its PCI device's ``numa_node`` in sysfs (the snapshot, mounted over /sys)."""

import os
import types

NVML_AFFINITY_SCOPE_NODE = 0
GPUS_VARIABLE = "PLACEMENT_TOOLS_GPUS"


class NVMLError(Exception):
    pass


def _gpus():
    listed = os.environ.get(GPUS_VARIABLE, "")
    return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]


def nvmlInit():
    if not _gpus():
        raise NVMLError("Driver Not Loaded")


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < len(_gpus()):
        raise NVMLError("Invalid Argument")
    return _gpus()[index]


def nvmlDeviceGetPciInfo(handle):
    domain, rest = handle.split(":", 1)
    return types.SimpleNamespace(busId=f"{int(domain, 16):08X}:{rest.upper()}")


def nvmlDeviceGetMemoryAffinity(handle, node_set_size, scope):
    try:
        with open(f"/sys/bus/pci/devices/{handle}/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError) as e:
        raise NVMLError(f"Unknown Error: {e}") from None
    mask = [0] * node_set_size
    if 0 <= node < node_set_size * 64:
        mask[node // 64] |= 1 << (node % 64)
    return mask
