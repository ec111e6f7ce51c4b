"""Makes ``import sglang.srt.<module>`` skip sglang's own ``__init__`` (torch, transformers, Hugging Face patches).

That ``__init__`` costs about 8 s per process here and minutes under emulation,
for nothing placement or the launchers use. Importing this module registers the
``sglang`` package as a bare package on its real directory, so its submodules
import as usual while ``sglang/__init__.py`` never runs. The test suite loads it
in every interpreter it starts (``sitecustomize``); scripts that run inside the
emulated VM import it first.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def install() -> None:
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "sglang is not installed in this interpreter: run scripts/setup.sh first"
        )
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["sglang"] = package


def bare_package(name: str) -> None:
    """Register sglang package ``name`` on its real directory without running its ``__init__``.

    For scripts inside the emulated VM: ``sglang.srt.utils``'s ``__init__`` imports torch
    (minutes there), while the modules under it that placement owns import nothing heavy.
    """
    if name in sys.modules:
        return
    parent, _, child = name.rpartition(".")
    spec = importlib.util.find_spec(parent)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{parent} is not installed in this interpreter: run scripts/setup.sh first"
        )
    import os

    for location in spec.submodule_search_locations:
        directory = os.path.join(location, child)
        if os.path.isdir(directory):
            package = types.ModuleType(name)
            package.__path__ = [directory]
            package.__file__ = os.path.join(directory, "__init__.py")
            sys.modules[name] = package
            return
    raise ImportError(f"{name} is not a package directory under {parent}")


PLATFORM_VAR = "PLACEMENT_TESTS_PLATFORM"
_NUMA_UTILS = "sglang.srt.utils.numa_utils"


def fake_host_from_environment() -> None:
    """With ``PLACEMENT_TESTS_PLATFORM=cuda``, this interpreter is on a CUDA platform for
    numa_utils (see sitecustomize and tests/fakehost.py)."""
    import os

    if os.environ.get(PLATFORM_VAR) == "cuda":
        sys.meta_path.insert(0, _CudaPlatform())


class _CudaPlatform:
    """Sets ``numa_utils._is_cuda`` once that module is loaded (loading it here would
    import torch in every interpreter), and gives ``torch.cuda`` the GPUs the stand-in
    NVML lists (``FAKE_NVML_GPUS``, tests/fakes/pynvml.py) as the CUDA runtime shows
    them under CUDA_VISIBLE_DEVICES: their count and each one's PCI address."""

    def find_spec(self, name, path, target=None):
        if name != _NUMA_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module._is_cuda, module._is_xpu = True, False
            torch = getattr(module, "torch", None)  # (a module that imports it)
            if torch is not None:
                torch.cuda.device_count = _visible_gpu_count
                torch.cuda.get_device_properties = _device_properties

        spec.loader.exec_module = exec_module
        return spec


def _driver_gpus() -> list:
    import os

    return [g for g in os.environ.get("FAKE_NVML_GPUS", "").split(",") if g]


def _visible_gpu_count() -> int:
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(_driver_gpus())
    return len([v for v in visible.split(",") if v.strip()])


def _device_properties(device: int):
    """The PCI location of CUDA device ``device``, as torch's device properties give it."""
    import torch

    if not 0 <= device < _visible_gpu_count():
        raise AssertionError("Invalid device id")
    index = torch.cuda._get_nvml_device_index(device)
    gpus = _driver_gpus()
    if not 0 <= index < len(gpus):
        raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
    domain, bus, slot = gpus[index].split(":")
    return types.SimpleNamespace(
        pci_domain_id=int(domain, 16),
        pci_bus_id=int(bus, 16),
        pci_device_id=int(slot.split(".")[0], 16),
    )


install()
