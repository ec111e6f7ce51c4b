"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) on hosts without a GPU: the calls
sglang makes, answered as the real NVML answers them for the GPUs that
``FAKE_NVML_GPUS`` lists (PCI addresses, comma-separated, in NVML's order; a container
given some of a host's GPUs lists only those). A GPU's memory affinity is the
``numa_node`` of its PCI device in sysfs, as NVML reads it. Without ``FAKE_NVML_GPUS``
``nvmlInit`` fails as it does where no driver is loaded; with ``FAKE_NVML_ERROR`` it
fails with that message while the GPUs stay listed for the CUDA runtime (the test
harness's ``torch.cuda`` stand-in), as where NVML alone is broken."""

import ctypes
import hashlib
import os
import types

NVML_AFFINITY_SCOPE_NODE = 0


class NVMLError(Exception):
    pass


def _gpus():
    listed = os.environ.get("FAKE_NVML_GPUS", "")
    return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]


def nvmlInit():
    if os.environ.get("FAKE_NVML_ERROR"):
        raise NVMLError(os.environ["FAKE_NVML_ERROR"])
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


def nvmlDeviceGetUUID(handle):
    return "GPU-" + hashlib.sha256(handle.encode()).hexdigest()[:32]


def nvmlDeviceGetHandleByUUID(uuid):
    for handle in _gpus():
        if nvmlDeviceGetUUID(handle) == uuid:
            return handle
    raise NVMLError("Not Found")


def nvmlDeviceGetPciInfo(handle):
    domain, rest = handle.split(":", 1)
    return types.SimpleNamespace(busId=f"{int(domain, 16):08x}:{rest}".upper())


def nvmlDeviceGetMemoryAffinity(handle, node_set_size, scope):
    try:
        with open(f"/sys/bus/pci/devices/{handle}/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError) as e:
        raise NVMLError(f"Unknown Error ({e})")
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = [0] * node_set_size
    if 0 <= node < node_set_size * bits:
        mask[node // bits] |= 1 << (node % bits)
    return mask
