"""The physical accelerator, and PCI address, that a rank's logical device index names.
Drivers are asked only through an ``AcceleratorRuntime`` (NVML, optional), never torch:
its CUDA initialisation in a launcher breaks the children it forks later."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import logging
import os
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Protocol, Sequence

from sglang.srt.placement import topology
from sglang.srt.placement.types import (
    Accelerator,
    DeviceIndex,
    DeviceRef,
    HostTopology,
    PciDevice,
    SettingError,
)

logger = logging.getLogger(__name__)

# (vendor, PCI class) of GPUs (display, 3D, processing accelerator): no audio, NVSwitch.
_GPUS = {
    "cuda": {("10de", "0300"), ("10de", "0302")},
    "xpu": {("8086", kind) for kind in ("0300", "0380", "1200")},
}
_PCI_RE = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")
_ZE_ENTRY_RE = re.compile(r"([0-9]{1,9})(?:\.[0-9]{1,9})?")
_PCI_ID_ORDER = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"
_NODE_GLOB = "devices/system/node/node[0-9]*"
_VISIBILITY = ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


def canonical_pci_address(text: str) -> Optional[str]:
    """``dddd:bb:dd.f`` in lower case (domain 0 when absent, NVML's 8-digit domain
    shortened, VMD's above ffff kept as sysfs writes it), or None."""
    m = _PCI_RE.fullmatch(text.strip().lower())
    return None if m is None else f"{int(m[1] or '0', 16):04x}:{m[2]}:{m[3]}.{m[4]}"


class AcceleratorRuntime(Protocol):
    """PCI addresses by physical index (PCI bus order) or UUID (or unique prefix)."""

    name: str

    def pci_by_index(self, index: int) -> Optional[str]: ...
    def pci_by_uuid(self, uuid: str) -> Optional[str]: ...


class NvmlRuntime:
    """One NVML session. Its indices are physical (PCI bus order), CUDA_VISIBLE_DEVICES
    aside; in a container they count only its own GPUs, as CUDA's and Ray's do."""

    name = "nvml"

    def __init__(self) -> None:
        import pynvml  # optional dependency: nvidia-ml-py

        self._nvml = pynvml
        pynvml.nvmlInit()

    def close(self) -> None:
        self._ask("nvmlShutdown")

    def _ask(self, call: str, *args: Any) -> Any:  # None: no answer, or asked of None
        with contextlib.suppress(self._nvml.NVMLError):
            return None if None in args else getattr(self._nvml, call)(*args)
        return None

    def handle_by_index(self, index: int) -> Any:
        return self._ask("nvmlDeviceGetHandleByIndex", index)

    def handle_by_uuid(self, uuid: str) -> Any:
        handle = self._ask("nvmlDeviceGetHandleByUUID", uuid)
        if handle is None:  # CUDA takes a unique prefix of a UUID; NVML, a whole one
            count = self._ask("nvmlDeviceGetCount") or 0
            handles = [self.handle_by_index(i) for i in range(count)]
            uuids = [_text(self._ask("nvmlDeviceGetUUID", h)).lower() for h in handles]
            found = [h for h, u in zip(handles, uuids) if u.startswith(uuid.lower())]
            handle = found[0] if len(found) == 1 else None
        if uuid.upper().startswith("MIG-"):  # no PCI function of its own: its GPU's
            handle = self._ask("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        return handle

    def pci_by_index(self, index: int) -> Optional[str]:
        return self.pci_of(self.handle_by_index(index))

    def pci_by_uuid(self, uuid: str) -> Optional[str]:
        return self.pci_of(self.handle_by_uuid(uuid))

    def pci_of(self, handle: Any) -> Optional[str]:
        info = self._ask("nvmlDeviceGetPciInfo", handle)
        return None if info is None else canonical_pci_address(_text(info.busId))

    def memory_nodes(self, handle: Any) -> tuple[int, ...]:
        """The nodes NVML's memory affinity names (NVMLError when it cannot)."""
        count = len(glob.glob(os.path.join(topology.SYSFS_ROOT, _NODE_GLOB)))
        bits = ctypes.sizeof(ctypes.c_ulong) * 8
        words = self._nvml.nvmlDeviceGetMemoryAffinity(
            handle, max(1, -(-count // bits)), self._nvml.NVML_AFFINITY_SCOPE_NODE
        )
        return tuple(n for n in range(count) if words[n // bits] >> (n % bits) & 1)


def _text(value: bytes | str | None) -> str:  # pynvml answers bytes or str
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def is_live(topology: HostTopology) -> bool:  # this host's /sys, not a tree of files
    return os.path.realpath(topology.root) == "/sys"


def usable_nvidia_gpus() -> int:
    """The NVIDIA GPUs this process may open: in a container, fewer than sysfs lists."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def usable_intel_gpus() -> frozenset[str]:
    """The PCI addresses of the render nodes this process may open, which are the GPUs
    Level Zero counts: in a container, fewer than sysfs lists."""
    found = set()
    for node in glob.glob("/dev/dri/renderD*"):
        if os.access(node, os.R_OK | os.W_OK):
            link = f"/sys/class/drm/{os.path.basename(node)}/device"
            found.add(canonical_pci_address(os.path.basename(os.path.realpath(link))))
    return frozenset(found - {None})


# The last (topology, device, its GPUs): planning an engine asks once per rank.
_listed: tuple = (None, None, ())


def accelerator_pci_devices(
    topology: HostTopology, *, device: str
) -> tuple[PciDevice, ...]:
    global _listed
    last_topology, last_device, last = _listed  # one read: threads may replace it
    if last_topology is topology and last_device == device:  # a topology never changes
        return last
    bare = lambda value: value.lower().removeprefix("0x")  # a snapshot may lack "0x"
    ids, pci = _GPUS.get(device, ()), topology.pci_devices
    found = [d for d in pci if (bare(d.vendor), bare(d.pci_class)[:4]) in ids]
    found.sort(key=lambda d: (int(d.address[:-8], 16), d.address))
    _listed = (topology, device, tuple(found))
    return _listed[2]


def gpus_on_node(topology: HostTopology, *, device: str, node: int) -> tuple[str, ...]:
    """The PCI addresses of ``node``'s GPUs, in PCI order."""
    found = accelerator_pci_devices(topology, device=device)
    return tuple(gpu.address for gpu in found if gpu.numa_node == node)


class _Order(NamedTuple):  # the host's GPUs as the runtime numbers them, in words
    listed: tuple[PciDevice, ...]  # in its index order
    vendor: str
    text: str  # "PCI bus order"
    lists: str  # "sysfs under /sys lists 4 NVIDIA GPU(s)"
    note: str = ""  # why CUDA's index may not be the one counted here
    unusable: str = ""  # why sysfs order cannot tell which GPU is which


def _order(device: str, topology: HostTopology, env: Mapping[str, str]) -> _Order:
    listed = accelerator_pci_devices(topology, device=device)
    if device == "xpu" and is_live(topology):  # Level Zero counts only these
        listed = tuple(d for d in listed if d.address in usable_intel_gpus())
    lists = f"sysfs under {topology.root} lists {len(listed)}"
    if device == "xpu":
        value = env.get(_PCI_ID_ORDER, "").strip()
        value = f"{_PCI_ID_ORDER}={value}" if value not in ("", "0") else ""
        if not value:  # integrated GPUs (domain 0, bus 0) last, the others in order
            listed = tuple(sorted(listed, key=lambda d: d.address[:8] == "0000:00:"))
        text = f"Level Zero order (PCI bus order, {value or 'integrated GPUs last'})"
        flat = "in Level Zero's FLAT hierarchy each tile of a card counts as a device"
        lists = f"{lists} Intel GPU(s) this process may open ({flat})"
        return _Order(listed, "Intel", text, lists)
    note = unusable = ""
    if len(listed) != 1 and env.get("CUDA_DEVICE_ORDER", "").strip() != "PCI_BUS_ID":
        note = "; CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA may count fastest first"
    usable = usable_nvidia_gpus() if is_live(topology) else len(listed)
    if usable < len(listed):
        unusable = (
            f"sysfs lists {len(listed)} NVIDIA GPUs but this process may use {usable} "
            "(/dev/nvidiaN), as in a container: without NVML which is which is unknown"
        )
    lists = f"{lists} NVIDIA GPU(s)"
    return _Order(listed, "NVIDIA", "PCI bus order", lists, note, unusable)


def identify_accelerators(
    *,
    device: str,
    topology: HostTopology,
    logical_ids: Sequence[int],
    env: Mapping[str, str],
    runtime: Optional[AcceleratorRuntime] = None,
) -> tuple[Accelerator, ...]:
    """The visibility variable's entry, else the index, names the physical device,
    whose address ``runtime`` gives, else sysfs order. ``env`` is the rank's own: a
    physical index is a logical one without the visibility variable."""
    if device == "cpu":
        return ()
    if device not in _GPUS:
        raise SettingError(f"--device {device!r}: expected cuda, xpu or cpu.")
    order = _order(device, topology, env)
    found = (_physical(device, i, env, len(order.listed)) for i in logical_ids)
    return tuple(_locate(acc, runtime, order) for acc in found)


def _locate(
    acc: Accelerator, runtime: Optional[AcceleratorRuntime], order: _Order
) -> Accelerator:
    text, origin, name = acc.physical_id, f"({acc.source})", runtime and runtime.name
    made = functools.partial(dataclasses.replace, acc)
    if not text.isdigit():  # a UUID: only a runtime knows its address
        pci = runtime and runtime.pci_by_uuid(text)
        if pci:
            return made(pci=pci, source=f"{name}: {text} {origin}")
        mig = " is a MIG instance: it" * text.upper().startswith("MIG-")
        why = f"{text} {origin}{mig} needs NVML to map a UUID to a PCI address"
        if runtime:
            why = f"{name} knows no device {text} {origin}; an abbreviated UUID must "
            why += "match exactly one GPU"
        return made(source=f"unknown: {why}")
    index, told = int(text), f"{origin}{order.note}"
    pci = runtime and runtime.pci_by_index(index)
    if pci:
        return made(pci=pci, source=f"{name}: physical device {index} {told}")
    missed = f"{name} has no device {index}; " if runtime else ""
    if not order.unusable and index < len(order.listed):
        source = f"sysfs: {missed}{order.vendor} GPU {index} in {order.text} {told}"
        return made(pci=order.listed[index].address, source=source)
    why = order.unusable or f"{order.lists}, none at index {index} {origin}"
    return made(source=f"unknown: {missed}{why}")


def parse_cuda_visible_devices(text: str) -> tuple[str, ...]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA honours: it stops at the
    first invalid one (``"0,2,-1,1"`` shows 0 and 2)."""
    entries = []
    for entry in map(str.strip, text.split(",")):
        if re.fullmatch(r"[+-]?[0-9]{1,18}", entry) and int(entry) >= 0:
            entry = str(int(entry))
        elif entry[:4].upper() not in ("GPU-", "MIG-") or len(entry) <= 4:
            break
        entries.append(entry)
    return tuple(entries)


def _physical(device: str, gpu_id: int, env: Mapping[str, str], n: int) -> Accelerator:
    """The device logical index ``gpu_id`` names, no address yet (``source``: how), of
    ``n`` here."""
    var = "CUDA_VISIBLE_DEVICES" if device == "cuda" else "ZE_AFFINITY_MASK"
    value = env.get(var)
    if gpu_id < 0:
        fix = "check --base-gpu-id and --gpu-id-step"
        raise SettingError(f"GPU id {gpu_id!r} is not a device index; {fix}.")
    if value is None or device == "xpu" and value.strip() in ("", "default"):
        return Accelerator(gpu_id, str(gpu_id), None, f"no {var}")
    if device == "cuda":
        entries, word, note = parse_cuda_visible_devices(value), "GPU", ""
        if 0 < len(entries) <= value.count(","):
            note = " (CUDA ignores the entries from the first invalid one on)"
    else:
        # Level Zero's mask filters, it does not permute ("3,1" shows 1 and 3, as 0
        # and 1); card.tile shows its card; no index, or a card not listed, is skipped.
        value, word = value.strip(), "device"
        parts = [part.strip() for part in value.split(",")]
        cards = [int(m[1]) if (m := _ZE_ENTRY_RE.fullmatch(p)) else n for p in parts]
        entries = tuple(map(str, sorted({card for card in cards if card < n})))
        skipped = [repr(p) for p, card in zip(parts, cards) if str(card) not in entries]
        note = f"; entries {', '.join(skipped)} skipped" if skipped else ""
    if gpu_id >= len(entries):
        shows = f"makes {len(entries)} {word}(s) visible{note}"
        fix = f"list more {word}s or lower --base-gpu-id / --tp-size"
        if device == "cuda" and not entries:
            shows = "hides every GPU"
            fix = "unset it, list the GPUs (e.g. 0,1), or use --device cpu"
        raise SettingError(
            f"{var}={value!r} {shows}, but a rank uses GPU id {gpu_id}; {fix}."
        )
    origin = f"{var}={value!r} entry {gpu_id}"
    if device == "xpu":
        shown = f"{','.join(entries)} in index order, device {gpu_id} is"
        origin = f"{var}={value!r} shows devices {shown} {entries[gpu_id]}{note}"
    return Accelerator(gpu_id, entries[gpu_id], None, origin)


@dataclasses.dataclass(frozen=True)
class GpuLocation:
    nodes: tuple[int, ...]  # its NUMA node(s); empty: unknown, for ``source``
    pci: Optional[str]
    source: str


def locate_gpu(
    gpu: DeviceRef,
    *,
    device: str,
    env: Mapping[str, str],
    host: Callable[[], HostTopology],
) -> GpuLocation:
    """Where GPU ``gpu`` is: for CUDA, NVML's memory affinity where NVML answers (as
    upstream asks it); else, and for XPU, the node of its PCI function in ``host()``'s
    sysfs. ``env`` is the rank's own (its visibility variable)."""
    if device == "cuda":
        try:
            nvml = NvmlRuntime()
        except ImportError:
            why = "pynvml is not installed"
        except Exception as exc:  # NVMLError: no driver, library or access
            why = f"NVML unavailable ({exc})"
        else:
            try:
                return _nvml_location(nvml, gpu, env)
            except SettingError as exc:
                return GpuLocation((), None, str(exc))
            except nvml._nvml.NVMLError as exc:
                why = f"NVML could not answer for {gpu.label} ({exc})"
            finally:
                nvml.close()
        logger.info(f"{why}: {gpu.label}'s NUMA node from its PCI device in sysfs")
    if gpu.numbering is DeviceIndex.PHYSICAL_GPU:  # no visibility variable counts
        env = {k: v for k, v in env.items() if k not in _VISIBILITY}
    tree = host()
    try:
        found = identify_accelerators(
            device=device, topology=tree, logical_ids=[gpu.index], env=env
        )[0]
    except SettingError as exc:
        return GpuLocation((), None, str(exc))
    known = found.pci and tree.pci_device(found.pci)
    if not known or known.numa_node is None:
        why = f"PCI {found.pci} reports numa_node -1" if known else found.source
        return GpuLocation((), found.pci, f"{gpu.label}: {why}")
    source = f"{gpu.label} is {found.physical_id} at PCI {found.pci} ({found.source})"
    return GpuLocation((known.numa_node,), found.pci, source)


def _nvml_location(
    nvml: NvmlRuntime, gpu: DeviceRef, env: Mapping[str, str]
) -> GpuLocation:
    entry = str(gpu.index)
    if gpu.numbering is DeviceIndex.LOGICAL_GPU and "CUDA_VISIBLE_DEVICES" in env:
        entries = parse_cuda_visible_devices(env["CUDA_VISIBLE_DEVICES"])
        if gpu.index >= len(entries):
            raise SettingError(
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} makes "
                f"{len(entries)} GPU(s) visible, but a rank uses GPU id {gpu.index}; "
                "list more GPUs or lower --base-gpu-id / --tp-size."
            )
        entry = entries[gpu.index]
    if entry.isdigit():
        handle = nvml.handle_by_index(int(entry))
    else:
        handle = nvml.handle_by_uuid(entry)
    if handle is None:
        return GpuLocation((), None, f"NVML knows no device {entry} ({gpu.label})")
    nodes = nvml.memory_nodes(handle)
    source = f"NVML memory affinity of {gpu.label} (NVML device {entry})"
    return GpuLocation(nodes, nvml.pci_of(handle), source)
