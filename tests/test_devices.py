"""Logical device index -> physical device -> PCI address (sglang.srt.placement.devices)."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from sglang.srt.placement import devices
from sglang.srt.placement.devices import (
    NvmlRuntime,
    accelerator_pci_devices,
    canonical_pci_address,
    identify_accelerators,
    parse_cuda_visible_devices,
)
from sglang.srt.placement.types import Accelerator, HostTopology, NumaNode, PciDevice
from sglang.srt.placement_tools.engine import ListedGpus, check_gpus

# Four NVIDIA GPUs on two nodes, listed out of bus order as a directory listing may be,
# plus things identification must skip: a GPU's audio function, an NVSwitch bridge, a NIC.
GPU_ADDRS = ("0000:17:00.0", "0000:2a:00.0", "0000:81:00.0", "0000:c1:00.0")
UUIDS = (
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-1b7e9c42-0000-4d1e-9a3e-5c1f00000001",
    "GPU-1b7e9c42-0000-4d1e-9a3e-5c1f00000002",
    "GPU-f00dbeef-1111-2222-3333-444455556666",
)


def make_topology(
    pci: tuple[PciDevice, ...] | None = None, root: str = "/fake/sys"
) -> HostTopology:
    if pci is None:
        pci = (
            PciDevice("0000:81:00.0", 1, "0x10de", "0x2335", "0x030200"),
            PciDevice("0000:17:00.0", 0, "0x10de", "0x2335", "0x030200"),
            PciDevice("0000:17:00.1", 0, "0x10de", "0x22e8", "0x040300"),
            PciDevice("0000:c1:00.0", 1, "0x10de", "0x2335", "0x030200"),
            PciDevice("0000:05:00.0", 0, "0x10de", "0x22a3", "0x068000"),
            PciDevice("0000:2a:00.0", 0, "0x10de", "0x2335", "0x030000"),
            PciDevice("0000:3b:00.0", 0, "0x15b3", "0x1021", "0x020000"),
        )
    nodes = (
        NumaNode(node_id=0, cpus=frozenset(range(0, 8)), memory_kb=1 << 20),
        NumaNode(node_id=1, cpus=frozenset(range(8, 16)), memory_kb=1 << 20),
    )
    return HostTopology(
        root=root,
        nodes=nodes,
        cpus=(),
        online_cpus=frozenset(range(16)),
        pci_devices=pci,
    )


TOPO = make_topology()
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def cuda(gpu_ids, env, **kw) -> tuple[Accelerator, ...]:
    topology = kw.pop("topology", TOPO)
    return identify(gpu_ids, env, device="cuda", topology=topology, **kw)


def identify(gpu_ids, env, *, device, topology, gpus=None, runtime=None):
    """As placement identifies them; ``gpus`` as the tools' --gpus hands them over."""
    if gpus is not None:
        text = gpus if isinstance(gpus, str) else ",".join(gpus)
        found = check_gpus(text, topology=topology, gpu_ids=gpu_ids)
        runtime = ListedGpus(found)
        env = {k: v for k, v in env.items() if "VISIBLE" not in k and "MASK" not in k}
    return identify_accelerators(
        device=device, topology=topology, logical_ids=gpu_ids, env=env, runtime=runtime
    )


@pytest.fixture
def nvml(monkeypatch):
    """NvmlRuntime over a pynvml stand-in (``fake_pynvml`` keywords)."""

    def make(**kw):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(**kw))
        return NvmlRuntime()

    return make


# --- a pynvml stand-in with the real module's calling conventions -------------------------


class FakeNVMLError(Exception):
    pass


def fake_pynvml(
    addrs=GPU_ADDRS,
    uuids=UUIDS,
    *,
    bytes_ids: bool = False,
    mig: dict[str, int] | None = None,
    calls=None,
):
    """A module object shaped like pynvml: ctypes handles, 8-digit upper-case bus ids."""
    mig = mig or {}
    calls = calls if calls is not None else []
    state = {"init": 0}

    class PciInfo:
        def __init__(self, index):
            domain, bus, rest = addrs[index].split(":")
            text = f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"
            self.busId = text.encode() if bytes_ids else text
            self.busIdLegacy = f"{int(domain, 16):04X}:{bus.upper()}:{rest.upper()}"

    def need_init():
        if state["init"] <= 0:
            raise FakeNVMLError("Uninitialized")

    def nvmlInit():
        state["init"] += 1

    def nvmlShutdown():
        need_init()
        state["init"] -= 1

    def nvmlDeviceGetCount():
        need_init()
        return len(addrs)

    def nvmlDeviceGetHandleByIndex(index):
        need_init()
        calls.append(("index", index))
        if not 0 <= index < len(addrs):
            raise FakeNVMLError("Invalid Argument")
        return ctypes.c_void_p(0x1000 + index)

    def nvmlDeviceGetHandleByUUID(uuid):
        need_init()
        calls.append(("uuid", uuid))
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        if text in uuids:
            return ctypes.c_void_p(0x1000 + uuids.index(text))
        if text in mig:
            return ctypes.c_void_p(0x2000 + mig[text])
        # NVML wants the whole UUID; prefixes are not found.
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
        need_init()
        if handle.value < 0x2000:
            raise FakeNVMLError("Invalid Argument")
        return ctypes.c_void_p(0x1000 + handle.value - 0x2000)

    def nvmlDeviceGetUUID(handle):
        need_init()
        return uuids[handle.value - 0x1000]

    def nvmlDeviceGetPciInfo(handle):
        need_init()
        if handle.value >= 0x2000:
            raise FakeNVMLError(
                "Not Supported"
            )  # MIG handles have no PCI info of their own
        return PciInfo(handle.value - 0x1000)

    module = types.SimpleNamespace(
        **{name: obj for name, obj in locals().items() if name.startswith("nvml")}
    )
    module.NVMLError = FakeNVMLError
    module.state = state
    return module


# --- addresses and --gpus --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("0000:81:00.0", "0000:81:00.0"),
        ("81:00.0", "0000:81:00.0"),
        ("0000:C1:1F.7", "0000:c1:1f.7"),
        ("00000000:81:00.0", "0000:81:00.0"),  # NVML
        ("10000:01:00.0", "10000:01:00.0"),  # Intel VMD domain, as sysfs writes it
        (" 0000:81:00.0\n", "0000:81:00.0"),
        ("0000:81:00", None),
        ("0000:81:20.0", None),  # device numbers stop at 0x1f
        ("0000:81:00.8", None),
        ("gpu0", None),
    ],
)
def test_canonical_pci_address(text, want):
    assert canonical_pci_address(text) == want


def test_gpus_option_maps_index_to_address_in_order():
    accs = cuda([0, 1, 2], {}, gpus=["81:00.0", "0000:17:00.0", "0000:C1:00.0"])
    assert [a.pci for a in accs] == ["0000:81:00.0", "0000:17:00.0", "0000:c1:00.0"]
    assert all(a.source.startswith("--gpus: physical device") for a in accs)
    assert [a.index for a in accs] == [0, 1, 2]


def test_gpus_option_wins_over_cuda_visible_devices():
    (acc,) = cuda(
        [1], {"CUDA_VISIBLE_DEVICES": "3,2"}, gpus="0000:17:00.0,0000:2a:00.0"
    )
    assert acc.pci == "0000:2a:00.0" and acc.source.startswith("--gpus")


def test_gpus_option_as_comma_string():
    assert check_gpus("81:00.0, 0000:17:00.0", topology=TOPO, gpu_ids=[]) == (
        "0000:81:00.0",
        "0000:17:00.0",
    )


@pytest.mark.parametrize(
    "value, bad",
    [
        ("0000:81:00.0,cuda:1", "'cuda:1'"),
        ("0000:81:00", "'0000:81:00'"),
        ("0000:81:00.0,,0000:17:00.0", "is not valid: give up to 4096 PCI addresses"),
        ("", "--gpus='' is not valid"),
    ],
)
def test_gpus_option_malformed(value, bad):
    with pytest.raises(ValueError) as info:
        cuda([0], {}, gpus=value)
    message = str(info.value)
    assert "--gpus" in message and bad in message
    assert "0000:17:00.0,0000:81:00.0" in message  # an example of a valid value


def test_gpus_option_duplicate_after_canonicalisation():
    with pytest.raises(
        ValueError,
        match=r"--gpus=.*0000:81:00\.0 is listed twice \(entries 0 and 1\).*e\.g\. --gpus",
    ):
        cuda([0], {}, gpus=["0000:81:00.0", "81:00.0"])


def test_gpus_option_too_short_for_the_gpu_id():
    with pytest.raises(
        ValueError, match=r"--gpus lists 2 address\(es\).*GPU id 2.*e\.g\. --gpus"
    ):
        cuda([0, 2], {}, gpus=["0000:81:00.0", "0000:17:00.0"])


def test_gpus_option_address_not_on_this_host_names_sysfs_root():
    with pytest.raises(
        ValueError,
        match=r"--gpus: 0000:82:00\.0 \(device index 0\) is not among the 7 PCI devices read from /fake/sys",
    ):
        cuda([0], {}, gpus=["0000:82:00.0"])


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------


def test_sysfs_order_lists_nvidia_gpus_only_sorted_by_address():
    assert (
        tuple(d.address for d in accelerator_pci_devices(TOPO, device="cuda"))
        == GPU_ADDRS
    )
    assert accelerator_pci_devices(TOPO, device="cpu") == ()


def test_no_visible_devices_variable_uses_index_itself():
    accs = cuda([0, 3], PCI_ORDER)
    assert [(a.physical_id, a.pci) for a in accs] == [
        ("0", GPU_ADDRS[0]),
        ("3", GPU_ADDRS[3]),
    ]
    assert accs[1].source.startswith(
        "sysfs: NVIDIA GPU 3 in PCI bus order (no CUDA_VISIBLE_DEVICES)"
    )


def test_reordered_visible_devices_map_to_the_right_pci():
    accs = cuda([0, 1], {"CUDA_VISIBLE_DEVICES": "3,1", **PCI_ORDER})
    assert [(a.index, a.physical_id, a.pci) for a in accs] == [
        (0, "3", GPU_ADDRS[3]),
        (1, "1", GPU_ADDRS[1]),
    ]
    assert "CUDA_VISIBLE_DEVICES='3,1' entry 1" in accs[1].source


def test_reordered_visible_devices_through_nvml(nvml):
    runtime = nvml()
    accs = cuda([0, 1], {"CUDA_VISIBLE_DEVICES": "3,1", **PCI_ORDER}, runtime=runtime)
    assert [a.pci for a in accs] == [GPU_ADDRS[3], GPU_ADDRS[1]]
    assert (
        accs[0].source == "nvml: physical device 3 (CUDA_VISIBLE_DEVICES='3,1' entry 0)"
    )


def test_index_order_without_pci_bus_id_order_says_so(nvml):
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": "2"})
    assert acc.pci == GPU_ADDRS[2]
    assert "CUDA_DEVICE_ORDER is not PCI_BUS_ID" in acc.source
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": "2"}, runtime=nvml())
    assert (
        acc.source.startswith("nvml:")
        and "CUDA_DEVICE_ORDER is not PCI_BUS_ID" in acc.source
    )


def test_single_gpu_host_needs_no_order_note():
    one = make_topology(
        (PciDevice("0000:18:00.0", None, "0x10de", "0x2335", "0x030200"),)
    )
    (acc,) = cuda([0], {}, topology=one)
    assert acc.pci == "0000:18:00.0" and "CUDA_DEVICE_ORDER" not in acc.source


def test_uuid_through_nvml_full_and_prefix(nvml):
    runtime = nvml()
    env = {"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},GPU-8932f937"}
    accs = cuda([0, 1], env, runtime=runtime)
    assert [(a.physical_id, a.pci) for a in accs] == [
        (UUIDS[2], GPU_ADDRS[2]),
        ("GPU-8932f937", GPU_ADDRS[0]),
    ]
    assert accs[1].source.startswith("nvml: GPU-8932f937 (CUDA_VISIBLE_DEVICES=")


def test_ambiguous_uuid_prefix_is_not_guessed(nvml):
    runtime = nvml()
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": "GPU-1b7e9c42"}, runtime=runtime)
    assert acc.pci is None
    assert acc.source.startswith("unknown: nvml knows no device GPU-1b7e9c42")


def test_uuid_without_runtime_has_no_pci_and_says_why():
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": UUIDS[1]})
    assert acc.pci is None and acc.physical_id == UUIDS[1]
    assert acc.source.startswith(f"unknown: {UUIDS[1]}")
    assert "needs NVML to map a UUID to a PCI address" in acc.source


def test_mig_entry_without_runtime_maps_to_nothing_with_reason():
    mig = "MIG-4b0a3f5e-7c1d-5e2f-8a9b-0c1d2e3f4a5b"
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": mig})
    assert acc.pci is None and acc.physical_id == mig
    assert "is a MIG instance" in acc.source and acc.source.startswith("unknown:")


def test_mig_entry_through_nvml_maps_to_parent_gpu(nvml):
    mig = "MIG-4b0a3f5e-7c1d-5e2f-8a9b-0c1d2e3f4a5b"
    runtime = nvml(mig={mig: 2})
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": mig}, runtime=runtime)
    assert acc.pci == GPU_ADDRS[2]


@pytest.mark.parametrize("value", ["", "-1", " -1 ", "-1,0"])
def test_visible_devices_hiding_everything_is_an_error(value):
    with pytest.raises(
        ValueError, match=rf"CUDA_VISIBLE_DEVICES={value!r} hides every GPU.*GPU id 0"
    ):
        cuda([0], {"CUDA_VISIBLE_DEVICES": value})


def test_visible_devices_stop_at_first_invalid_entry_like_cuda():
    assert parse_cuda_visible_devices("0,2,-1,1") == ("0", "2")
    assert parse_cuda_visible_devices(" 1 , GPU-abc,x,3") == ("1", "GPU-abc")
    with pytest.raises(
        ValueError,
        match=r"CUDA_VISIBLE_DEVICES='0,2,-1,1' makes 2 GPU\(s\) visible \(CUDA ignores",
    ):
        cuda([2], {"CUDA_VISIBLE_DEVICES": "0,2,-1,1"})


def test_gpu_id_out_of_range_names_variable_value_and_id():
    with pytest.raises(
        ValueError,
        match=r"CUDA_VISIBLE_DEVICES='3,1' makes 2 GPU\(s\) visible, but a rank uses GPU id 2",
    ):
        cuda([0, 2], {"CUDA_VISIBLE_DEVICES": "3,1"})


def test_physical_index_missing_from_sysfs_gives_reason():
    (acc,) = cuda([0], {"CUDA_VISIBLE_DEVICES": "7"})
    assert acc.pci is None
    assert acc.source.startswith(
        "unknown: sysfs under /fake/sys lists 4 NVIDIA GPU(s), none at index 7"
    )


def test_bad_gpu_ids_and_device():
    with pytest.raises(ValueError, match="GPU id -1 is not a device index"):
        cuda([-1], {})
    with pytest.raises(ValueError, match="--device 'npu'"):
        identify_accelerators(device="npu", topology=TOPO, logical_ids=[0], env={})


def test_cpu_device_has_no_accelerators():
    assert (
        identify_accelerators(device="cpu", topology=TOPO, logical_ids=[0, 1], env={})
        == ()
    )


# --- NvmlRuntime -------------------------------------------------------------------------------


@pytest.mark.parametrize("bytes_ids", [False, True])
def test_nvml_bus_id_canonicalised(bytes_ids, monkeypatch):
    module = fake_pynvml(
        addrs=("0000:81:00.0", "0001:C1:1F.0"), uuids=UUIDS[:2], bytes_ids=bytes_ids
    )
    monkeypatch.setitem(sys.modules, "pynvml", module)
    runtime = NvmlRuntime()
    assert module.state["init"] == 1
    assert runtime.pci_by_index(0) == "0000:81:00.0"
    assert runtime.pci_by_index(1) == "0001:c1:1f.0"
    assert runtime.pci_by_index(2) is None
    assert runtime.pci_by_uuid(UUIDS[1]) == "0001:c1:1f.0"
    assert runtime.pci_by_uuid("GPU-00000000") is None
    runtime.close()
    assert module.state["init"] == 0


# --- a container given some of the host's GPUs -------------------------------------------------


def test_without_nvml_a_container_never_takes_another_gpus_node(monkeypatch, nvml):
    """sysfs lists the host's 4 GPUs; the container has 2 (/dev/nvidia2, /dev/nvidia3).
    Its CUDA index 0 is the host's GPU 2: NVML knows, sysfs order cannot tell."""
    live = make_topology(root="/sys")
    monkeypatch.setattr(devices, "usable_nvidia_gpus", lambda: 2)
    (acc,) = cuda([0], PCI_ORDER, topology=live)
    assert acc.pci is None
    assert "sysfs lists 4 NVIDIA GPUs but this process may use 2" in acc.source
    container = fake_pynvml(addrs=GPU_ADDRS[2:], uuids=UUIDS[2:])
    monkeypatch.setitem(sys.modules, "pynvml", container)
    (acc,) = cuda([0], PCI_ORDER, topology=live, runtime=NvmlRuntime())
    assert acc.pci == GPU_ADDRS[2] and acc.source.startswith("nvml: physical device 0")
    # On a bare host every GPU is usable: sysfs order is the physical order.
    monkeypatch.setattr(devices, "usable_nvidia_gpus", lambda: 4)
    (acc,) = cuda([1], PCI_ORDER, topology=live)
    assert acc.pci == GPU_ADDRS[1] and acc.source.startswith("sysfs:")


# --- XPU -----------------------------------------------------------------------------------------

XPU_TOPO = make_topology(
    (
        PciDevice("0000:9a:00.0", 1, "0x8086", "0x0bd5", "0x038000"),
        PciDevice("0000:29:00.0", 0, "0x8086", "0x0bd5", "0x038000"),
        PciDevice("0000:00:02.0", 0, "0x8086", "0x4680", "0x030000"),
        PciDevice("0000:00:1f.3", 0, "0x8086", "0x7ad0", "0x040300"),
        PciDevice("0000:4d:00.0", 0, "0x8086", "0x56c0", "0x120000"),
        PciDevice("0000:17:00.0", 0, "0x10de", "0x2335", "0x030200"),
    )
)


def xpu(gpu_ids, env, **kw):
    return identify(gpu_ids, env, device="xpu", topology=XPU_TOPO, **kw)


def test_xpu_level_zero_order_puts_the_integrated_gpu_last():
    # sysfs lists every Intel GPU in PCI bus order, the integrated one (domain 0000, bus 00) first ...
    order = [d.address for d in accelerator_pci_devices(XPU_TOPO, device="xpu")]
    assert order == ["0000:00:02.0", "0000:29:00.0", "0000:4d:00.0", "0000:9a:00.0"]
    # ... and Level Zero numbers it last unless ZE_ENABLE_PCI_ID_DEVICE_ORDER asks for plain PCI order.
    for env in (
        {},
        {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "0"},
        {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": " "},
    ):
        accs = xpu([0, 1, 2, 3], env)
        assert [a.pci for a in accs] == [
            "0000:29:00.0",
            "0000:4d:00.0",
            "0000:9a:00.0",
            "0000:00:02.0",
        ]
        assert accs[0].source == (
            "sysfs: Intel GPU 0 in Level Zero order (PCI bus order, integrated GPUs last) (no ZE_AFFINITY_MASK)"
        )
    for value in ("1", "true"):
        accs = xpu([0, 1, 3], {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": value})
        assert [a.pci for a in accs] == ["0000:00:02.0", "0000:29:00.0", "0000:9a:00.0"]
        assert accs[1].source == (
            f"sysfs: Intel GPU 1 in Level Zero order (PCI bus order, ZE_ENABLE_PCI_ID_DEVICE_ORDER={value}) "
            "(no ZE_AFFINITY_MASK)"
        )


def test_level_zero_order_puts_only_domain_0_bus_0_last():
    devices = XPU_TOPO.pci_devices + (
        PciDevice("0001:00:02.0", 0, "0x8086", "0x0bd5", "0x038000"),
        PciDevice("0000:01:00.0", 0, "0x8086", "0x0bd5", "0x038000"),
    )
    accs = identify_accelerators(
        device="xpu", topology=make_topology(devices), logical_ids=range(6), env={}
    )
    assert [a.pci for a in accs] == [
        "0000:01:00.0",
        "0000:29:00.0",
        "0000:4d:00.0",
        "0000:9a:00.0",
        "0001:00:02.0",
        "0000:00:02.0",
    ]


def test_ze_affinity_mask_filters_and_does_not_permute():
    # Unlike CUDA_VISIBLE_DEVICES, the mask only chooses devices; they keep Level Zero's order.
    accs = xpu([0, 1], {"ZE_AFFINITY_MASK": "2,0"})
    assert [(a.physical_id, a.pci) for a in accs] == [
        ("0", "0000:29:00.0"),
        ("2", "0000:9a:00.0"),
    ]
    assert accs[0].source.endswith(
        "(ZE_AFFINITY_MASK='2,0' shows devices 0,2 in index order, device 0 is 0)"
    )
    # The integrated GPU is device 3 here, so masking it in makes it the last visible device.
    accs = xpu([0, 1], {"ZE_AFFINITY_MASK": "3,1"})
    assert [a.pci for a in accs] == ["0000:4d:00.0", "0000:00:02.0"]


def test_ze_affinity_mask_subdevices_name_their_card():
    env = {"ZE_AFFINITY_MASK": "3,1.1,1.0", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    accs = xpu([0, 1], env)
    # Both tiles of card 1 make card 1 visible once; card 3 follows it.
    assert [(a.physical_id, a.pci) for a in accs] == [
        ("1", "0000:29:00.0"),
        ("3", "0000:9a:00.0"),
    ]
    with pytest.raises(
        ValueError,
        match=r"ZE_AFFINITY_MASK='3,1.1,1.0' makes 2 device\(s\) visible, but a rank",
    ):
        xpu([2], env)


def test_ze_affinity_mask_skips_entries_it_cannot_use():
    # As Level Zero does: an entry that is no index, or names a device beyond the four here, is skipped.
    (acc,) = xpu([1], {"ZE_AFFINITY_MASK": "gpu1, 2 ,7,,1.x,0"})
    assert acc.pci == "0000:9a:00.0"
    assert (
        "shows devices 0,2 in index order, device 1 is 2; entries 'gpu1', '7', '', '1.x' skipped"
        in acc.source
    )
    with pytest.raises(
        ValueError,
        match=r"ZE_AFFINITY_MASK='0,1' makes 2 device\(s\) visible, but a rank uses GPU id 2",
    ):
        xpu([2], {"ZE_AFFINITY_MASK": "0,1"})
    with pytest.raises(ValueError, match=r"ZE_AFFINITY_MASK='gpu1' makes 0 device\(s\) visible; entries 'gpu1' "
                                         r"skipped, but a rank uses GPU id 0"):  # fmt: skip
        xpu([0], {"ZE_AFFINITY_MASK": "gpu1"})
    (acc,) = xpu([1], {"ZE_AFFINITY_MASK": "default"})
    assert acc.pci == "0000:4d:00.0" and "no ZE_AFFINITY_MASK" in acc.source


def test_xpu_index_beyond_cards_mentions_flat_hierarchy():
    (acc,) = xpu([5], {})
    assert acc.pci is None and "FLAT hierarchy" in acc.source


def test_xpu_gpus_option():
    (acc,) = xpu([0], {"ZE_AFFINITY_MASK": "3"}, gpus="29:00.0")
    assert acc.pci == "0000:29:00.0" and acc.source.startswith("--gpus")


# --- through a sysfs tree read by read_topology --------------------------------------------------


def test_read_topology_tree_gives_gpus_in_bus_order(tmp_path):
    from fakesys import gpu_unknown_node, two_sockets_four_gpus

    from sglang.srt.placement.topology import read_topology

    topo = read_topology(two_sockets_four_gpus(tmp_path / "four"))
    accs = identify_accelerators(
        device="cuda",
        topology=topo,
        logical_ids=[0, 1],
        env={"CUDA_VISIBLE_DEVICES": "3,0", **PCI_ORDER},
    )
    assert [a.pci for a in accs] == ["0000:48:00.0", "0000:18:00.0"]
    assert [topo.pci_device(a.pci).numa_node for a in accs] == [1, 0]
    with pytest.raises(
        ValueError, match=f"not among the 5 PCI devices read from {tmp_path / 'four'}"
    ):
        identify([0], {}, device="cuda", topology=topo, gpus="0000:19:00.0")

    # A GPU whose numa_node is -1 (the one-GPU cloud VM) is still identified; its node is unknown.
    topo = read_topology(gpu_unknown_node(tmp_path / "unknown", gpus=1))
    (acc,) = identify_accelerators(
        device="cuda", topology=topo, logical_ids=[0], env={}
    )
    assert acc.pci == "0000:18:00.0" and "CUDA_DEVICE_ORDER" not in acc.source
    assert topo.pci_device(acc.pci).numa_node is None
