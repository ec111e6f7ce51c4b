"""Which physical accelerator, and which PCI address, a rank's logical device index names.

A logical index (``cuda:1``) means nothing on its own: ``CUDA_VISIBLE_DEVICES``
(indices or UUIDs), the ids Ray assigned to an actor, or ``ZE_AFFINITY_MASK``
choose the physical device, and its PCI address decides the NUMA node.
``identify_accelerators`` is pure given its inputs; whatever must be asked of a
driver goes through an ``AcceleratorRuntime``. NVML is optional, never required.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from sglang.srt.placement.types import Accelerator, HostTopology, PciDevice

logger = logging.getLogger(__name__)

NVIDIA_VENDOR = "10de"
INTEL_VENDOR = "8086"
# PCI class prefixes (base class + subclass): VGA, 3D controller, other display,
# processing accelerator. Audio functions and NVSwitch bridges on the same card are left out.
NVIDIA_GPU_CLASSES = ("0300", "0302")
INTEL_GPU_CLASSES = ("0300", "0380", "1200")

GPUS_OPTION = "--gpus"
GPUS_EXAMPLE = "--gpus 0000:17:00.0,0000:81:00.0"

_PCI_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{4,8}):)?(?P<bus>[0-9a-f]{2}):(?P<dev>[0-9a-f]{2})\.(?P<fn>[0-7])$"
)
_INT_RE = re.compile(r"^[+-]?[0-9]+$")
_ZE_ENTRY_RE = re.compile(r"^(?P<card>[0-9]+)(?:\.(?P<sub>[0-9]+))?$")


class DeviceIdentityError(ValueError):
    """A device setting (``--gpus``, ``CUDA_VISIBLE_DEVICES``, Ray ids, ``ZE_AFFINITY_MASK``) cannot name a device."""


def canonical_pci_address(text: str) -> Optional[str]:
    """``dddd:bb:dd.f`` in lower case, or None when ``text`` is not a PCI address.

    Accepts ``bb:dd.f`` (domain 0) and NVML's 8-digit domain (``00000000:81:00.0``).
    Domains above ``ffff`` (Intel VMD) keep all their digits, as sysfs writes them.
    """
    match = _PCI_RE.match(text.strip().lower())
    if match is None:
        return None
    domain = int(match["domain"] or "0", 16)
    device = int(match["dev"], 16)
    if device > 0x1F:
        return None
    return f"{domain:04x}:{match['bus']}:{device:02x}.{match['fn']}"


def parse_gpus_option(value: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """The ``--gpus`` value as canonical PCI addresses, in device-index order."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        raw = value
    else:
        parts = [str(part).strip() for part in value]
        raw = ",".join(parts)
    if not parts or parts == [""]:
        raise DeviceIdentityError(
            f"{GPUS_OPTION} is empty; give one PCI address per device index, e.g. {GPUS_EXAMPLE}."
        )
    addresses: list[str] = []
    for position, part in enumerate(parts):
        address = canonical_pci_address(part)
        if address is None:
            raise DeviceIdentityError(
                f"{GPUS_OPTION}={raw!r}: entry {position} ({part!r}) is not a PCI address; "
                f"expected dddd:bb:dd.f or bb:dd.f, e.g. {GPUS_EXAMPLE}."
            )
        if address in addresses:
            raise DeviceIdentityError(
                f"{GPUS_OPTION}={raw!r}: {address} is listed twice (entries {addresses.index(address)} "
                f"and {position}); each device index needs its own GPU, e.g. {GPUS_EXAMPLE}."
            )
        addresses.append(address)
    return tuple(addresses)


class AcceleratorRuntime(Protocol):
    """What identification asks of a driver library (NVML, or a stand-in in tests):
    the PCI address of a physical device index (PCI bus order), or of a
    ``GPU-``/``MIG-`` UUID or unique UUID prefix."""

    name: str

    def pci_by_index(self, index: int) -> Optional[str]: ...

    def pci_by_uuid(self, uuid: str) -> Optional[str]: ...


class NvmlRuntime:
    """Physical device index or UUID to PCI address through NVML (pynvml / nvidia-ml-py).

    NVML numbers devices in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``,
    so its indices are physical. ``module`` replaces the ``pynvml`` import in tests.
    """

    name = "nvml"

    def __init__(self, *, module: Any = None) -> None:
        if module is None:
            import pynvml as module  # optional dependency: nvidia-ml-py

        self._nvml = module
        self._error: type[BaseException] = getattr(module, "NVMLError", Exception)
        module.nvmlInit()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except self._error as exc:
                logger.debug(f"nvmlShutdown failed: {exc}")

    def pci_by_index(self, index: int) -> Optional[str]:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
        except self._error as exc:
            logger.debug(f"NVML has no device {index}: {exc}")
            return None
        return self._pci_of(handle)

    def pci_by_uuid(self, uuid: str) -> Optional[str]:
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        except self._error:
            handle = self._handle_by_uuid_prefix(uuid)
            if handle is None:
                return None
        if uuid.upper().startswith("MIG-"):
            try:
                # A MIG instance has no PCI function of its own; it lives on its parent GPU.
                handle = self._nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            except self._error as exc:
                logger.debug(f"NVML cannot find the parent GPU of {uuid}: {exc}")
                return None
        return self._pci_of(handle)

    def _handle_by_uuid_prefix(self, prefix: str) -> Any:
        # CUDA accepts any unique prefix of a GPU UUID; NVML wants the whole UUID.
        wanted = prefix.lower()
        found = []
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._error:
            return None
        for index in range(count):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
            except self._error:
                continue
            if uuid.lower().startswith(wanted):
                found.append(handle)
        return found[0] if len(found) == 1 else None

    def _pci_of(self, handle: Any) -> Optional[str]:
        try:
            bus_id = _text(self._nvml.nvmlDeviceGetPciInfo(handle).busId)
        except self._error as exc:
            logger.debug(f"NVML has no PCI info for a device: {exc}")
            return None
        address = canonical_pci_address(bus_id)
        if address is None:
            logger.warning(
                f"NVML returned a PCI bus id that is not an address: {bus_id!r}"
            )
        return address


def default_runtime(device: str) -> Optional[AcceleratorRuntime]:
    """NVML for CUDA when it imports and initialises, else None (sysfs order is the fallback).

    Never torch: initialising CUDA in a launcher breaks the children it forks later.
    """
    if device != "cuda":
        return None
    try:
        return NvmlRuntime()
    except ImportError:
        logger.debug("pynvml is not installed; GPU PCI addresses come from sysfs order")
    except (
        Exception
    ) as exc:  # NVMLError subclasses: no driver, no library, no permission
        logger.debug(
            f"NVML did not initialise ({exc}); GPU PCI addresses come from sysfs order"
        )
    return None


def accelerator_pci_devices(
    topology: HostTopology, *, device: str
) -> tuple[PciDevice, ...]:
    """The GPUs of ``device``'s vendor that sysfs lists, in PCI bus order."""
    if device == "cuda":
        vendor, classes = NVIDIA_VENDOR, NVIDIA_GPU_CLASSES
    elif device == "xpu":
        vendor, classes = INTEL_VENDOR, INTEL_GPU_CLASSES
    else:
        return ()
    found = [
        dev
        for dev in topology.pci_devices
        if _hex(dev.vendor) == vendor and _hex(dev.pci_class)[:4] in classes
    ]
    return tuple(sorted(found, key=_pci_sort_key))


PCI_ID_ORDER_VAR = "ZE_ENABLE_PCI_ID_DEVICE_ORDER"


def pci_id_order(env: Mapping[str, str]) -> bool:
    """Whether ``ZE_ENABLE_PCI_ID_DEVICE_ORDER`` asks Level Zero for plain PCI order (set, and not "0")."""
    return env.get(PCI_ID_ORDER_VAR, "").strip() not in ("", "0")


def is_integrated_intel_gpu(address: str) -> bool:
    """An Intel integrated GPU sits on the root bus: PCI domain 0000, bus 00."""
    domain, _, rest = address.partition(":")
    try:
        return int(domain, 16) == 0 and int(rest.partition(":")[0], 16) == 0
    except ValueError:
        return False


def level_zero_order(
    devices: Sequence[PciDevice], *, env: Mapping[str, str]
) -> tuple[PciDevice, ...]:
    """Intel GPUs in the order Level Zero numbers them: PCI bus order, integrated GPUs last unless
    ``ZE_ENABLE_PCI_ID_DEVICE_ORDER`` is set (intel/compute-runtime sorts by PCI id that way).

    With the integrated GPU last, a runtime that leaves it out of its device list
    numbers the discrete GPUs the same way.
    """
    ordered = sorted(devices, key=_pci_sort_key)
    if pci_id_order(env):
        return tuple(ordered)
    return tuple(sorted(ordered, key=lambda dev: is_integrated_intel_gpu(dev.address)))


def identify_accelerators(
    *,
    device: str,
    topology: HostTopology,
    gpu_ids: Sequence[int],
    env: Mapping[str, str],
    gpus: Union[str, Sequence[str], None] = None,
    ray_accelerator_ids: Optional[Sequence[str]] = None,
    runtime: Optional[AcceleratorRuntime] = None,
) -> tuple[Accelerator, ...]:
    """One Accelerator per requested logical device index, in order.

    Precedence: ``gpus`` (the ``--gpus`` option) names PCI addresses directly; otherwise
    the physical device is Ray's assigned id, else the device's visibility variable
    (``CUDA_VISIBLE_DEVICES`` / ``ZE_AFFINITY_MASK``) entry, else the index itself; its
    PCI address comes from ``runtime`` when given, else from sysfs PCI bus order (for
    Intel GPUs, Level Zero's order: see ``level_zero_order``).
    ``env`` must be the environment the rank's process runs with.
    """
    if device == "cpu":
        return ()
    if device not in ("cuda", "xpu"):
        raise DeviceIdentityError(
            f"--device {device!r} has no accelerator identity; expected cuda, xpu or cpu."
        )
    for gpu_id in gpu_ids:
        if not isinstance(gpu_id, int) or isinstance(gpu_id, bool) or gpu_id < 0:
            raise DeviceIdentityError(
                f"GPU id {gpu_id!r} is not a device index; check --base-gpu-id and --gpu-id-step."
            )
    if gpus is not None:
        return _from_gpus_option(
            topology=topology, gpu_ids=gpu_ids, gpus=parse_gpus_option(gpus)
        )
    listed = accelerator_pci_devices(topology, device=device)
    if device == "xpu":
        listed = level_zero_order(listed, env=env)
    result = []
    for gpu_id in gpu_ids:
        if device == "cuda":
            physical = _cuda_physical(
                gpu_id=gpu_id, env=env, ray_ids=ray_accelerator_ids
            )
        else:
            physical = _xpu_physical(
                gpu_id=gpu_id, env=env, ray_ids=ray_accelerator_ids, cards=len(listed)
            )
        result.append(
            _locate(
                gpu_id=gpu_id,
                physical=physical,
                device=device,
                env=env,
                listed=listed,
                topology=topology,
                runtime=runtime,
            )
        )
    return tuple(result)


@dataclass(frozen=True)
class _Physical:
    text: str
    """As the runtime names it: "3", "GPU-8932f937...", "MIG-..."."""
    index: Optional[int]
    """Physical index, when the entry is one."""
    origin: str
    """Where the entry came from, for the source text."""


def _from_gpus_option(
    *, topology: HostTopology, gpu_ids: Sequence[int], gpus: tuple[str, ...]
) -> tuple[Accelerator, ...]:
    result = []
    for gpu_id in gpu_ids:
        if gpu_id >= len(gpus):
            raise DeviceIdentityError(
                f"{GPUS_OPTION} lists {len(gpus)} address(es) ({','.join(gpus)}) but a rank uses GPU id "
                f"{gpu_id}; list one PCI address per device index 0..{max(gpu_ids)}, e.g. {GPUS_EXAMPLE}."
            )
        address = gpus[gpu_id]
        if topology.pci_device(address) is None:
            # A typo must not leave the rank silently unbound.
            raise DeviceIdentityError(
                f"{GPUS_OPTION}: {address} (device index {gpu_id}) is not among the "
                f"{len(topology.pci_devices)} PCI devices read from {topology.root}; "
                f"check the address with `lspci -D`, e.g. {GPUS_EXAMPLE}."
            )
        result.append(
            Accelerator(
                gpu_id=gpu_id, physical_id=address, pci=address, source=GPUS_OPTION
            )
        )
    return tuple(result)


def parse_cuda_visible_devices(text: str) -> tuple[str, ...]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA honours, in order.

    CUDA stops at the first invalid entry (a negative index, or text that is
    neither an index nor a ``GPU-``/``MIG-`` UUID): ``"0,2,-1,1"`` makes 0 and 2 visible.
    """
    entries: list[str] = []
    for part in text.split(","):
        entry = part.strip()
        if _INT_RE.match(entry):
            if int(entry) < 0:
                break
            entries.append(str(int(entry)))
        elif entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
            entries.append(entry)
        else:
            break
    return tuple(entries)


def _ray_entry(ray_ids: Sequence[str], gpu_id: int) -> str:
    if gpu_id >= len(ray_ids):
        raise DeviceIdentityError(
            f"Ray assigned this actor GPU ids {list(ray_ids)} but the rank uses GPU id {gpu_id}; "
            f"request as many GPUs per actor as the rank's device index needs."
        )
    return str(ray_ids[gpu_id]).strip()


def _cuda_physical(
    *, gpu_id: int, env: Mapping[str, str], ray_ids: Optional[Sequence[str]]
) -> _Physical:
    if ray_ids:
        entry = _ray_entry(ray_ids, gpu_id)
        return _physical_entry(
            entry, origin=f"Ray GPU id {entry!r} (index {gpu_id} of {list(ray_ids)})"
        )
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return _Physical(
            text=str(gpu_id), index=gpu_id, origin="no CUDA_VISIBLE_DEVICES"
        )
    entries = parse_cuda_visible_devices(visible)
    if not entries:
        raise DeviceIdentityError(
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU, but a rank uses GPU id {gpu_id}; "
            f"unset it, list the GPUs (e.g. CUDA_VISIBLE_DEVICES=0,1), or use --device cpu."
        )
    if gpu_id >= len(entries):
        ignored = len(entries) < len([p for p in visible.split(",")])
        note = (
            " (CUDA ignores the entries from the first invalid one on)"
            if ignored
            else ""
        )
        raise DeviceIdentityError(
            f"CUDA_VISIBLE_DEVICES={visible!r} makes {len(entries)} GPU(s) visible{note}, "
            f"but a rank uses GPU id {gpu_id}; list more GPUs or lower --base-gpu-id / --tp-size."
        )
    return _physical_entry(
        entries[gpu_id], origin=f"CUDA_VISIBLE_DEVICES={visible!r} entry {gpu_id}"
    )


def _physical_entry(entry: str, *, origin: str) -> _Physical:
    if _INT_RE.match(entry) and int(entry) >= 0:
        return _Physical(text=str(int(entry)), index=int(entry), origin=origin)
    if entry[:4].upper() in ("GPU-", "MIG-") and len(entry) > 4:
        return _Physical(text=entry, index=None, origin=origin)
    raise DeviceIdentityError(
        f"{origin}: {entry!r} is neither a device index nor a GPU-/MIG- UUID."
    )


def _xpu_physical(
    *, gpu_id: int, env: Mapping[str, str], ray_ids: Optional[Sequence[str]], cards: int
) -> _Physical:
    if ray_ids:
        entry = _ray_entry(ray_ids, gpu_id)
        card = _ze_card(entry, what=f"Ray GPU id {entry!r}")
        return _Physical(
            text=entry,
            index=card,
            origin=f"Ray GPU id {entry!r} (index {gpu_id} of {list(ray_ids)})",
        )
    mask = env.get("ZE_AFFINITY_MASK", "").strip()
    if not mask or mask == "default":
        return _Physical(text=str(gpu_id), index=gpu_id, origin="no ZE_AFFINITY_MASK")
    visible, skipped = ze_affinity_cards(mask, cards=cards)
    note = f"; entries {', '.join(repr(e) for e in skipped)} skipped" if skipped else ""
    if gpu_id >= len(visible):
        raise DeviceIdentityError(
            f"ZE_AFFINITY_MASK={mask!r} makes {len(visible)} device(s) visible{note}, but a rank uses GPU id "
            f"{gpu_id}; list more devices or lower --base-gpu-id / --tp-size."
        )
    card = visible[gpu_id]
    listing = ",".join(str(c) for c in visible)
    return _Physical(
        text=str(card),
        index=card,
        origin=f"ZE_AFFINITY_MASK={mask!r} shows devices {listing} in index order, device {gpu_id} is {card}{note}",
    )


def ze_affinity_cards(mask: str, *, cards: int) -> tuple[list[int], list[str]]:
    """The devices ``ZE_AFFINITY_MASK`` leaves visible, in logical index order, and the entries it skips.

    As Level Zero reads it: the mask filters, it does not permute like
    ``CUDA_VISIBLE_DEVICES`` (``"3,1"`` shows devices 1 and 3, as 0 and 1); a
    sub-device entry ``card.tile`` shows its card; an entry that is not an index,
    or names a device beyond the ``cards`` there are, is skipped.
    """
    found: set[int] = set()
    skipped: list[str] = []
    for part in mask.split(","):
        entry = part.strip()
        match = _ZE_ENTRY_RE.match(entry)
        if match is None or int(match["card"]) >= cards:
            skipped.append(entry)
            continue
        found.add(int(match["card"]))
    return sorted(found), skipped


def _ze_card(entry: str, *, what: str) -> int:
    match = _ZE_ENTRY_RE.match(entry)
    if match is None:
        raise DeviceIdentityError(
            f"{what}: {entry!r} is not a device or device.sub-device index; expected e.g. ZE_AFFINITY_MASK=0,1.0."
        )
    return int(match["card"])


def _locate(
    *,
    gpu_id: int,
    physical: _Physical,
    device: str,
    env: Mapping[str, str],
    listed: tuple[PciDevice, ...],
    topology: HostTopology,
    runtime: Optional[AcceleratorRuntime],
) -> Accelerator:
    def made(pci: Optional[str], source: str) -> Accelerator:
        return Accelerator(
            gpu_id=gpu_id, physical_id=physical.text, pci=pci, source=source
        )

    missed = ""
    if runtime is not None:
        if physical.index is not None:
            pci = runtime.pci_by_index(physical.index)
            if pci is not None:
                note = _order_note(device=device, env=env, listed=listed)
                return made(
                    pci,
                    f"{runtime.name}: physical device {physical.index} ({physical.origin}){note}",
                )
            missed = f"{runtime.name} has no device {physical.index}; "
        else:
            pci = runtime.pci_by_uuid(physical.text)
            if pci is not None:
                return made(pci, f"{runtime.name}: {physical.text} ({physical.origin})")
            return made(
                None,
                f"unknown: {runtime.name} knows no device {physical.text} ({physical.origin}); "
                f"an abbreviated UUID must match exactly one GPU",
            )
    index = physical.index
    if index is None:
        needs = (
            "is a MIG instance ({}); NVML is needed to find its parent GPU's PCI "
            "address"
            if physical.text.upper().startswith("MIG-")
            else "({}) needs NVML to map a UUID to a PCI address"
        )
        return made(None, f"unknown: {physical.text} {needs.format(physical.origin)}")
    vendor = "NVIDIA" if device == "cuda" else "Intel"
    if index >= len(listed):
        hint = ""
        if device == "xpu":
            hint = "; in Level Zero's FLAT hierarchy each tile of a card counts as a device"
        return made(
            None,
            f"unknown: {missed}sysfs under {topology.root} lists {len(listed)} {vendor} GPU(s), "
            f"none at index {index} ({physical.origin}){hint}",
        )
    pci = listed[index].address
    note = _order_note(device=device, env=env, listed=listed)
    order = "PCI bus order"
    if device == "xpu":
        order = (
            f"Level Zero order (PCI bus order, {PCI_ID_ORDER_VAR}={env.get(PCI_ID_ORDER_VAR, '').strip()})"
            if pci_id_order(env)
            else "Level Zero order (PCI bus order, integrated GPUs last)"
        )
    return made(
        pci, f"sysfs: {missed}{vendor} GPU {index} in {order} ({physical.origin}){note}"
    )


def _order_note(
    *, device: str, env: Mapping[str, str], listed: tuple[PciDevice, ...]
) -> str:
    """Why an index-order mapping may be wrong, or "" when the order cannot differ."""
    if len(listed) == 1:
        return ""
    if (
        device == "cuda"
        and env.get("CUDA_DEVICE_ORDER", "").strip().upper() != "PCI_BUS_ID"
    ):
        return (
            "; NVML and sysfs count GPUs in PCI bus order but CUDA_DEVICE_ORDER is not PCI_BUS_ID, "
            "so CUDA's fastest-first order may differ (set CUDA_DEVICE_ORDER=PCI_BUS_ID)"
        )
    return ""


def _text(value: Any) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def _hex(value: str) -> str:
    text = value.strip().lower()
    return text[2:] if text.startswith("0x") else text


def _pci_sort_key(dev: PciDevice) -> tuple[int, str]:
    domain, _, rest = dev.address.partition(":")
    try:
        return (int(domain, 16), rest)
    except ValueError:
        return (0, dev.address)
