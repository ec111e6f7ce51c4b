"""The physical accelerator, and PCI address, that a rank's logical device index names.

A driver is asked only through an ``AcceleratorRuntime`` (NVML, optional); never
torch, whose CUDA initialisation in a launcher breaks the children it forks later.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import logging
import os
import re
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Protocol, Sequence

from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    PciDevice,
    SettingError,
)

logger = logging.getLogger(__name__)


# (vendor, PCI class) of GPUs: display, 3D, processing accelerator; not a card's
# audio function or an NVSwitch bridge.
_GPUS = {
    "cuda": {("10de", "0300"), ("10de", "0302")},
    "xpu": {("8086", kind) for kind in ("0300", "0380", "1200")},
}
_PCI_RE = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])")
_INDEX_RE = re.compile(r"[+-]?[0-9]{1,18}")
_ZE_ENTRY_RE = re.compile(r"([0-9]{1,9})(?:\.[0-9]{1,9})?")
_PCI_ID_ORDER = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"


def canonical_pci_address(text: str) -> Optional[str]:
    """``dddd:bb:dd.f`` in lower case (domain 0 when absent, NVML's 8-digit domain
    shortened, VMD's above ffff kept as sysfs writes it), or None."""
    match = _PCI_RE.fullmatch(text.strip().lower())
    if match is None:
        return None
    domain, bus, dev, fn = match.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{dev}.{fn}"


class AcceleratorRuntime(Protocol):
    """PCI addresses by physical index (PCI bus order) or UUID (or unique prefix)."""

    name: str

    def pci_by_index(self, index: int) -> Optional[str]: ...

    def pci_by_uuid(self, uuid: str) -> Optional[str]: ...


class NvmlRuntime:
    """NVML's indices are physical (PCI bus order), CUDA_VISIBLE_DEVICES aside; in a
    container they count only its own GPUs, as CUDA's and Ray's do."""

    name = "nvml"

    def __init__(self) -> None:
        import pynvml  # optional dependency: nvidia-ml-py

        self._nvml = pynvml
        self._error = getattr(pynvml, "NVMLError", Exception)
        pynvml.nvmlInit()

    def close(self) -> None:
        self._ask("nvmlShutdown")

    def _ask(self, call: str, *args: Any) -> Any:  # None: no answer, or asked of None
        try:
            return None if None in args else getattr(self._nvml, call)(*args)
        except self._error as exc:
            logger.debug(f"NVML {call} failed: {exc}")
            return None

    def pci_by_index(self, index: int) -> Optional[str]:
        return self._pci_of(self._ask("nvmlDeviceGetHandleByIndex", index))

    def pci_by_uuid(self, uuid: str) -> Optional[str]:
        handle = self._ask("nvmlDeviceGetHandleByUUID", uuid)
        if handle is None:  # CUDA takes a unique prefix of a UUID; NVML, a whole one
            count = self._ask("nvmlDeviceGetCount") or 0
            handles = [self._ask("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
            uuids = [_text(self._ask("nvmlDeviceGetUUID", h)).lower() for h in handles]
            found = [h for h, u in zip(handles, uuids) if u.startswith(uuid.lower())]
            handle = found[0] if len(found) == 1 else None
        if uuid.upper().startswith("MIG-"):  # no PCI function of its own: its GPU's
            handle = self._ask("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        return self._pci_of(handle)

    def _pci_of(self, handle: Any) -> Optional[str]:
        info = self._ask("nvmlDeviceGetPciInfo", handle)
        return None if info is None else canonical_pci_address(_text(info.busId))


def is_live(topology: HostTopology) -> bool:
    """Whether ``topology`` is this host's own /sys (not a snapshot or a fake)."""
    return os.path.realpath(topology.root) == "/sys"


@contextlib.contextmanager
def open_runtime(
    device: str, topology: HostTopology
) -> Iterator[Optional[AcceleratorRuntime]]:
    """NVML for CUDA on this host's own /sys when it imports and initialises, shut
    down after, as upstream does; else None (sysfs order)."""
    runtime = None
    if device == "cuda" and is_live(topology):
        try:
            runtime = NvmlRuntime()
        except Exception as exc:  # ImportError; NVMLError: no driver, library, access
            logger.debug(
                f"NVML unavailable ({exc!r}); GPU addresses follow sysfs order"
            )
    try:
        yield runtime
    finally:
        if runtime is not None:
            runtime.close()


def usable_nvidia_gpus() -> int:
    """The NVIDIA GPUs this process may open: a container given some of a host's GPUs
    has only their /dev/nvidiaN, while sysfs lists every GPU of the host."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def accelerator_pci_devices(
    topology: HostTopology, *, device: str
) -> tuple[PciDevice, ...]:
    ids, bare = _GPUS.get(device, ()), lambda v: v.lower().removeprefix("0x")
    # sysfs writes "0x10de"; a snapshot or --gpus-built tree may not.
    found = [
        d
        for d in topology.pci_devices
        if (bare(d.vendor), bare(d.pci_class)[:4]) in ids
    ]
    return tuple(sorted(found, key=lambda d: (int(d.address[:-8], 16), d.address)))


class _Physical(NamedTuple):
    text: str  # as the runtime names it: "3", "GPU-8932f937...", "MIG-..."
    index: Optional[int]  # None for a UUID
    origin: str


class _Order(NamedTuple):
    listed: tuple[PciDevice, ...]  # the host's GPUs, in the runtime's index order
    vendor: str
    text: str
    note: str = ""  # why CUDA's index may not be the one counted here
    flat: str = ""  # how Level Zero counts tiles


def _order(device: str, topology: HostTopology, env: Mapping[str, str]) -> _Order:
    listed = accelerator_pci_devices(topology, device=device)
    if device == "xpu":
        value = env.get(_PCI_ID_ORDER, "").strip()
        flat = "; in Level Zero's FLAT hierarchy each tile of a card counts as a device"
        if value in ("", "0"):
            # Level Zero numbers integrated GPUs (domain 0, bus 0) last: a runtime
            # that leaves them out numbers the others the same.
            listed = tuple(sorted(listed, key=lambda d: d.address[:8] == "0000:00:"))
            value = "integrated GPUs last"
        else:
            value = f"{_PCI_ID_ORDER}={value}"
        text = f"Level Zero order (PCI bus order, {value})"
        return _Order(listed, "Intel", text, flat=flat)
    note = ""
    if len(listed) != 1 and env.get("CUDA_DEVICE_ORDER", "").strip() != "PCI_BUS_ID":
        note = (
            "; NVML and sysfs count GPUs in PCI bus order but CUDA_DEVICE_ORDER is not "
            "PCI_BUS_ID, so CUDA's fastest-first order may differ (set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID)"
        )
    return _Order(listed, "NVIDIA", "PCI bus order", note)


def identify_accelerators(
    *,
    device: str,
    topology: HostTopology,
    gpu_ids: Sequence[int],
    env: Mapping[str, str],
    runtime: Optional[AcceleratorRuntime] = None,
) -> tuple[Accelerator, ...]:
    """The visibility variable's entry, else the index, names the physical device,
    whose address ``runtime`` gives, else sysfs order. ``env`` is the rank's own."""
    if device == "cpu":
        return ()
    if device not in _GPUS:
        raise SettingError(
            f"--device {device!r} has no accelerator identity; expected cuda, xpu "
            "or cpu."
        )
    for gpu_id in gpu_ids:
        if gpu_id < 0:
            raise SettingError(
                f"GPU id {gpu_id!r} is not a device index; check --base-gpu-id and "
                "--gpu-id-step."
            )
    order = _order(device, topology, env)
    locate = functools.partial(
        _locate, device=device, topology=topology, env=env, runtime=runtime, order=order
    )
    return tuple(map(locate, gpu_ids))


def _locate(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: Optional[AcceleratorRuntime],
    order: _Order,
) -> Accelerator:
    text, index, origin = _physical(device, gpu_id, env, len(order.listed))
    made = functools.partial(Accelerator, gpu_id, text)  # (pci, source)
    if runtime is not None and index is None:
        pci, found = runtime.pci_by_uuid(text), f"{text} ({origin})"
        if pci is None:
            why = "; an abbreviated UUID must match exactly one GPU"
            return made(None, f"unknown: {runtime.name} knows no device {found}{why}")
        return made(pci, f"{runtime.name}: {found}")
    missed = ""
    if runtime is not None:
        pci = runtime.pci_by_index(index)
        if pci is not None:
            source = f"physical device {index} ({origin}){order.note}"
            return made(pci, f"{runtime.name}: {source}")
        missed = f"{runtime.name} has no device {index}; "
    if index is None:
        mig = " is a MIG instance: it" * text.upper().startswith("MIG-")
        why = f"{mig} needs NVML to map a UUID to a PCI address"
        return made(None, f"unknown: {text} ({origin}){why}")
    count = len(order.listed)
    if device == "cuda" and is_live(topology):
        usable = usable_nvidia_gpus()
        if usable < count:
            return made(
                None,
                f"unknown: sysfs lists {count} NVIDIA GPUs but this process may use "
                f"{usable} (/dev/nvidiaN), as in a container given some of the "
                "host's GPUs: without NVML (nvidia-ml-py) which is which cannot be "
                "told, and another GPU's node would be guessed",
            )
    if index >= count:
        return made(
            None,
            f"unknown: {missed}sysfs under {topology.root} lists {count} "
            f"{order.vendor} GPU(s), none at index {index} ({origin}){order.flat}",
        )
    source = f"{missed}{order.vendor} GPU {index} in {order.text} ({origin})"
    source += order.note
    return made(order.listed[index].address, f"sysfs: {source}")


def parse_cuda_visible_devices(text: str) -> tuple[str, ...]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA honours: it stops at the
    first invalid one (``"0,2,-1,1"`` shows 0 and 2)."""
    found = (_cuda_entry(part.strip(), "") for part in text.split(","))
    return tuple(e.text for e in itertools.takewhile(lambda e: e is not None, found))


def _cuda_entry(entry: str, origin: str) -> Optional[_Physical]:
    if _INDEX_RE.fullmatch(entry) and int(entry) >= 0:
        return _Physical(str(int(entry)), int(entry), origin)
    if entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
        return _Physical(entry, None, origin)
    return None


def _physical(
    device: str, gpu_id: int, env: Mapping[str, str], count: int
) -> _Physical:
    var = "CUDA_VISIBLE_DEVICES" if device == "cuda" else "ZE_AFFINITY_MASK"
    value = env.get(var)
    if value is None or device == "xpu" and value.strip() in ("", "default"):
        return _Physical(str(gpu_id), gpu_id, f"no {var}")
    word, note = "GPU", ""
    if device == "cuda":
        entries: Sequence[Any] = parse_cuda_visible_devices(value)
        if 0 < len(entries) <= value.count(","):
            note = " (CUDA ignores the entries from the first invalid one on)"
    else:
        # Level Zero's mask filters, it does not permute ("3,1" shows 1 and 3, as 0
        # and 1); card.tile shows its card; no index, or a card not listed, is skipped.
        word, value = "device", value.strip()
        parts = [part.strip() for part in value.split(",")]
        numbers = [
            int(m[1]) if (m := _ZE_ENTRY_RE.fullmatch(p)) else None for p in parts
        ]
        entries = sorted({n for n in numbers if n is not None and n < count})
        skipped = [repr(p) for p, n in zip(parts, numbers) if n not in entries]
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
    if device == "cuda":
        return _cuda_entry(entries[gpu_id], f"{var}={value!r} entry {gpu_id}")
    card = entries[gpu_id]
    listing = ",".join(map(str, entries))
    origin = f"shows devices {listing} in index order, device {gpu_id} is {card}"
    return _Physical(str(card), card, f"{var}={value!r} {origin}{note}")


def _text(value: Any) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
