"""Light stand-ins for what ``numa_utils`` imports and the guest does not use.

Python in the emulated guest runs about twenty times slower than here, and importing
torch there takes over a minute, or ``sglang.srt.server_args`` and the
``sglang.srt.utils`` package (whose ``__init__`` imports torch and most of sglang)
longer. A rank spawned through ``configure_subprocess`` needs none of them: the
module-level ``import torch``, ``ServerArgs`` (a type hint) and ``is_cuda``/``is_xpu``
are all the spawn path touches, besides ``torch.cuda``'s device count and PCI
locations for a GPU rank and ``get_cpu_ids_by_node`` for a CPU one. ``install()``
registers modules for exactly these; the rest of ``numa_utils`` (its libnuma calls,
numactl probe, wrapper, ``init_threads_binding``) and ``sglang.srt.environ`` run as
they are. Anything else of the stand-ins raises, naming itself.
"""

from __future__ import annotations

import glob
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "harness"))
import sglang_light  # noqa: E402


def _not_in_guest(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name} is not stood in for in the VM guest")

    return call


def _cpu_ids_by_node() -> list:
    """sglang's get_cpu_ids_by_node on this kernel (one thread per core in the guest):
    each node's CPUs, by node id, for the nodes that have any."""
    found = []
    for path in glob.glob("/sys/devices/system/node/node[0-9]*"):
        with open(os.path.join(path, "cpulist")) as f:
            text = f.read().strip()
        if text:
            found.append((int(os.path.basename(path)[4:]), text))
    cpus = []
    for _, text in sorted(found):
        ids = []
        for part in text.split(","):
            first, _, last = part.partition("-")
            ids.extend(range(int(first), int(last or first) + 1))
        cpus.append(",".join(map(str, ids)))
    return cpus


def _nvml_index(device: int) -> int:
    """torch.cuda._get_nvml_device_index for integer CUDA_VISIBLE_DEVICES lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return device
    return [int(v) for v in visible.split(",") if v.strip()][device]


def install() -> None:
    """Register the stand-ins, then sglang without its package ``__init__``s."""
    torch = types.ModuleType("torch")
    torch.__file__ = __file__
    torch.cuda = types.SimpleNamespace(
        device_count=sglang_light._visible_gpu_count,
        get_device_properties=sglang_light._device_properties,
        _get_nvml_device_index=_nvml_index,
    )
    torch.xpu = types.SimpleNamespace(device_count=lambda: 0)
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = type("ServerArgs", (), {})
    sys.modules.update({"torch": torch, "sglang.srt.server_args": server_args})
    sglang_light.install()
    sglang_light.bare_package("sglang.srt.utils")
    utils = sys.modules["sglang.srt.utils"]
    utils.is_cuda = utils.is_xpu = lambda: False
    utils.get_cpu_ids_by_node = _cpu_ids_by_node
    for name in ("parse_lscpu_topology", "set_gpu_proc_affinity"):
        setattr(utils, name, _not_in_guest(name))
