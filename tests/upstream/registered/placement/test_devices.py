"""Which physical GPU, and which PCI address, a logical device index names."""

import unittest
from unittest.mock import patch

from sglang.srt.placement import devices
from sglang.srt.placement.devices import (
    canonical_pci_address,
    identify_accelerators,
    parse_cuda_visible_devices,
)
from sglang.srt.placement.types import HostTopology, PciDevice
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

GPUS = ("0000:17:00.0", "0000:31:00.0", "0000:b1:00.0")


def host():
    devices = tuple(
        PciDevice(address, node, vendor="10de", device="2330", pci_class="030200")
        for node, address in enumerate(GPUS)
    )
    return HostTopology(
        root="/fake/sys",
        nodes=(),
        cpus=(),
        online_cpus=frozenset(),
        pci_devices=devices,
    )


class TestDeviceIdentity(CustomTestCase):
    def test_cuda_visible_devices_stops_where_cuda_does(self):
        self.assertEqual(parse_cuda_visible_devices("2, 0,-1,1"), ("2", "0"))

    def test_pci_addresses_in_canonical_form(self):
        self.assertEqual(canonical_pci_address("00000000:B1:00.0"), "0000:b1:00.0")
        self.assertIsNone(canonical_pci_address("b1:20.0"))

    def test_a_logical_index_names_the_gpu_cuda_visible_devices_gives_it(self):
        found = identify_accelerators(
            device="cuda",
            topology=host(),
            logical_ids=[0, 1],
            env={"CUDA_VISIBLE_DEVICES": "2,0"},
        )
        self.assertEqual([a.pci for a in found], [GPUS[2], GPUS[0]])

    def test_an_xpu_index_counts_only_the_devices_this_process_may_open(self):
        intel = tuple(
            PciDevice(a, n, vendor="8086", device="0bd5", pci_class="038000")
            for n, a in enumerate(GPUS)
        )
        live = HostTopology("/sys", (), (), frozenset(), pci_devices=intel)
        # A container given the last two of the host's three cards (/dev/dri).
        with patch.object(devices, "usable_intel_gpus", return_value=set(GPUS[1:])):
            found = identify_accelerators(
                device="xpu", topology=live, logical_ids=[0, 1], env={}
            )
        self.assertEqual([a.pci for a in found], list(GPUS[1:]))


if __name__ == "__main__":
    unittest.main()
