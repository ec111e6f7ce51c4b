"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) on hosts without a GPU: the
operator tools' stand-in (``placement_tools/standin/pynvml.py``: the calls sglang makes,
answered as the real NVML answers them, a GPU's memory affinity being the ``numa_node``
of its PCI device in sysfs) for the GPUs ``FAKE_NVML_GPUS`` lists (PCI addresses,
comma-separated, in NVML's order; a container given some of a host's GPUs lists only
those), with what tests add: ``FAKE_NVML_ERROR`` makes ``nvmlInit`` fail with that
message while the GPUs stay listed for the CUDA runtime (the test harness's
``torch.cuda`` stand-in), as where NVML alone is broken; and each GPU's UUID."""

import hashlib
import os
from pathlib import Path

_STANDIN = Path(__file__).resolve().parents[2] / "python/sglang/srt/placement_tools"
exec(compile((_STANDIN / "standin/pynvml.py").read_text(), "standin/pynvml.py", "exec"))
GPUS_VARIABLE = "FAKE_NVML_GPUS"
_init = nvmlInit  # noqa: F821 (the stand-in's)


def nvmlInit():
    if os.environ.get("FAKE_NVML_ERROR"):
        raise NVMLError(os.environ["FAKE_NVML_ERROR"])  # noqa: F821
    _init()


def nvmlDeviceGetUUID(handle):
    return "GPU-" + hashlib.sha256(handle.encode()).hexdigest()[:32]


def nvmlDeviceGetHandleByUUID(uuid):
    for handle in _gpus():  # noqa: F821
        if nvmlDeviceGetUUID(handle) == uuid:
            return handle
    raise NVMLError("Not Found")  # noqa: F821
