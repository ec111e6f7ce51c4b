"""The physical accelerator, and PCI address, that a rank's logical device index names.

A driver is asked only through an ``AcceleratorRuntime`` (NVML, optional); never
torch, whose CUDA initialisation in a launcher breaks the children it forks later.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from typing import Any, Mapping, NamedTuple, Optional, Protocol, Sequence, Union

from sglang.srt.placement.settings import SettingError
from sglang.srt.placement.types import Accelerator, HostTopology, PciDevice

logger = logging.getLogger(__name__)


# (vendor, PCI class) of GPUs: display, 3D, processing accelerator; not a card's
# audio function or an NVSwitch bridge.
_GPUS = {
    "cuda": {("10de", "0300"), ("10de", "0302")},
    "xpu": {("8086", kind) for kind in ("0300", "0380", "1200")},
}
_GPUS_EXAMPLE = "e.g. --gpus 0000:17:00.0,0000:81:00.0."
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


def parse_gpus_option(value: Union[str, Sequence[str]]) -> tuple[str, ...]:
    raw = value if isinstance(value, str) else ",".join(map(str, value))
    if not raw.strip():
        raise SettingError(
            f"--gpus is empty; give one PCI address per device index, {_GPUS_EXAMPLE}"
        )
    found: list[str] = []
    for position, part in enumerate(raw.split(",")):
        address = canonical_pci_address(part)
        if address is None:
            raise SettingError(
                f"--gpus={raw!r}: entry {position} ({part.strip()!r}) is not a PCI "
                f"address; expected dddd:bb:dd.f or bb:dd.f, {_GPUS_EXAMPLE}"
            )
        if address in found:
            raise SettingError(
                f"--gpus={raw!r}: {address} is listed twice (entries "
                f"{found.index(address)} and {position}); each device index "
                f"needs its own GPU, {_GPUS_EXAMPLE}"
            )
        found.append(address)
    return tuple(found)


def check_gpus(
    value: Union[str, Sequence[str]], *, topology: HostTopology, gpu_ids: Sequence[int]
) -> tuple[str, ...]:
    """``--gpus`` parsed and checked against this host and the ranks' GPU ids: a typo
    or a missing address is a bad setting, never a rank left unbound."""
    found = parse_gpus_option(value)
    for index, address in enumerate(found):
        if topology.pci_device(address) is None:
            raise SettingError(
                f"--gpus: {address} (device index {index}) is not among the "
                f"{len(topology.pci_devices)} PCI devices read from {topology.root}; "
                f"check it with `lspci -D`, {_GPUS_EXAMPLE}"
            )
    if gpu_ids and max(gpu_ids) >= len(found):
        top = max(gpu_ids)
        raise SettingError(
            f"--gpus lists {len(found)} address(es) but a rank uses GPU id {top}: list "
            f"one PCI address per device index 0..{top} ({','.join(found)} given), "
            f"{_GPUS_EXAMPLE}"
        )
    return found


class AcceleratorRuntime(Protocol):
    """PCI addresses by physical index (PCI bus order) or UUID (or unique prefix)."""

    name: str

    def pci_by_index(self, index: int) -> Optional[str]: ...

    def pci_by_uuid(self, uuid: str) -> Optional[str]: ...


class NvmlRuntime:
    """NVML's indices are physical (PCI bus order), CUDA_VISIBLE_DEVICES aside."""

    name = "nvml"

    def __init__(self, *, module: Any = None) -> None:
        if module is None:
            import pynvml as module  # optional dependency: nvidia-ml-py

        self._nvml = module
        self._error = getattr(module, "NVMLError", Exception)
        module.nvmlInit()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
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


def default_runtime(device: str) -> Optional[AcceleratorRuntime]:
    """NVML for CUDA when it imports and initialises, else None (sysfs order)."""
    if device != "cuda":
        return None
    try:
        return NvmlRuntime()
    except Exception as exc:  # ImportError; NVMLError: no driver, library, permission
        logger.debug(f"NVML unavailable ({exc!r}); GPU addresses follow sysfs order")
        return None


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


def identify_accelerators(
    *,
    device: str,
    topology: HostTopology,
    gpu_ids: Sequence[int],
    env: Mapping[str, str],
    gpus: Union[str, Sequence[str], None] = None,
    runtime: Optional[AcceleratorRuntime] = None,
) -> tuple[Accelerator, ...]:
    """``--gpus`` names them outright; else the visibility variable's entry, else the
    index, names the physical device, whose address ``runtime`` gives, else sysfs
    order. ``env`` is the rank's own."""
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
    if gpus is not None:
        found = check_gpus(gpus, topology=topology, gpu_ids=gpu_ids)
        return tuple(Accelerator(i, found[i], found[i], "--gpus") for i in gpu_ids)
    listed = accelerator_pci_devices(topology, device=device)
    vendor, order, note, flat = "NVIDIA", "PCI bus order", "", ""
    if device == "xpu":
        vendor, value = "Intel", env.get(_PCI_ID_ORDER, "").strip()
        flat = "; in Level Zero's FLAT hierarchy each tile of a card counts as a device"
        if value in ("", "0"):
            # Level Zero numbers integrated GPUs (domain 0, bus 0) last: a runtime
            # that leaves them out numbers the others the same.
            listed = tuple(sorted(listed, key=lambda d: d.address[:8] == "0000:00:"))
            value = "integrated GPUs last"
        else:
            value = f"{_PCI_ID_ORDER}={value}"
        order = f"Level Zero order (PCI bus order, {value})"
    elif len(listed) != 1 and env.get("CUDA_DEVICE_ORDER", "").strip() != "PCI_BUS_ID":
        note = (
            "; NVML and sysfs count GPUs in PCI bus order but CUDA_DEVICE_ORDER is not "
            "PCI_BUS_ID, so CUDA's fastest-first order may differ (set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID)"
        )

    def locate(gpu_id: int) -> Accelerator:
        text, index, origin = _physical(device, gpu_id, env, len(listed))
        made = functools.partial(Accelerator, gpu_id, text)  # (pci, source)
        missed = ""
        if runtime is not None and index is None:
            pci, found = runtime.pci_by_uuid(text), f"{text} ({origin})"
            unknown = "; an abbreviated UUID must match exactly one GPU"
            if pci is None:
                return made(
                    None, f"unknown: {runtime.name} knows no device {found}{unknown}"
                )
            return made(pci, f"{runtime.name}: {found}")
        if runtime is not None:
            pci = runtime.pci_by_index(index)
            if pci is not None:
                source = f"physical device {index} ({origin}){note}"
                return made(pci, f"{runtime.name}: {source}")
            missed = f"{runtime.name} has no device {index}; "
        if index is None:
            mig = " is a MIG instance: it" * text.upper().startswith("MIG-")
            why = f"{mig} needs NVML to map a UUID to a PCI address"
            return made(None, f"unknown: {text} ({origin}){why}")
        if index >= len(listed):
            return made(
                None,
                f"unknown: {missed}sysfs under {topology.root} lists {len(listed)} "
                f"{vendor} GPU(s), none at index {index} ({origin}){flat}",
            )
        source = f"{missed}{vendor} GPU {index} in {order} ({origin}){note}"
        return made(listed[index].address, f"sysfs: {source}")

    return tuple(map(locate, gpu_ids))


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
