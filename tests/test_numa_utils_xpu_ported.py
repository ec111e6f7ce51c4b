"""sglang 0.5.23's tests of the XPU side of numa_utils, ported to the placement core.

0.5.23 found Intel GPUs through /dev/dri render nodes and private helpers;
the node of logical XPU device N is now answered by _query_numa_node_for_gpu
from the sysfs tree placement's topology.SYSFS_ROOT names (a small tree here), under the
ZE_AFFINITY_MASK and ZE_ENABLE_PCI_ID_DEVICE_ORDER in force. Comments mark
what differs from 0.5.23 on purpose.
"""

import os
import shutil
import stat
import tempfile
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement import topology
from sglang.srt.utils.numa_utils import (
    _is_numa_available,
    _query_numa_node_for_gpu,
    get_numa_node_if_available,
)


NUMA_UTILS_LOGGER = "sglang.srt.utils.numa_utils"
INTEL = "0x8086"

# Level Zero numbers these four Intel GPUs A, B, C, then the integrated one;
# each sits on its own node, so a node names the device.
IGPU = ("0000:00:02.0", 0, INTEL, "0x030000")  # integrated: domain 0000, bus 00
GPU_A = ("0000:29:00.0", 1, INTEL, "0x038000")
GPU_B = ("0000:4d:00.0", 2, INTEL, "0x038000")
GPU_C = ("0000:9a:00.0", 3, INTEL, "0x120000")  # a processing accelerator (Max)
NOT_GPUS = (
    ("0000:00:1f.3", 0, INTEL, "0x040300"),  # Intel audio
    ("0000:17:00.0", 0, "0x10de", "0x030200"),  # an NVIDIA GPU
)


def write_sysfs(root, nodes, pci=()):
    """A small sysfs tree: ``nodes`` maps node id -> CPUs; ``pci`` lists
    ``(address, numa_node, vendor, pci_class)``, numa_node -1 for unknown."""
    files = {}
    cpus = sorted(cpu for node_cpus in nodes.values() for cpu in node_cpus)
    files["devices/system/cpu/online"] = ",".join(map(str, cpus))
    for node, node_cpus in nodes.items():
        for cpu in node_cpus:
            base = f"devices/system/cpu/cpu{cpu}/topology"
            files[f"{base}/physical_package_id"] = str(node)
            files[f"{base}/core_id"] = str(cpu)
            files[f"{base}/thread_siblings_list"] = str(cpu)
    ids = sorted(nodes)
    for node in ids:
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = ",".join(map(str, sorted(nodes[node])))
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       16777216 kB\n"
        files[f"{base}/distance"] = " ".join("10" if n == node else "20" for n in ids)
    for address, numa_node, vendor, pci_class in pci:
        base = f"bus/pci/devices/{address}"
        files[f"{base}/numa_node"] = str(numa_node)
        files[f"{base}/vendor"] = vendor
        files[f"{base}/device"] = "0x0bd5"
        files[f"{base}/class"] = pci_class
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    return root


class _XpuHostCase(unittest.TestCase):
    """An XPU host of four NUMA nodes; each test chooses its Intel GPUs."""

    def setUp(self):
        # The environment is restored after everything else a test patched.
        for patcher in (
            patch.dict(os.environ),
            patch("sglang.srt.utils.numa_utils._is_cuda", False),
            patch("sglang.srt.utils.numa_utils._is_xpu", True),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        for name in ("ZE_AFFINITY_MASK", "ZE_ENABLE_PCI_ID_DEVICE_ORDER"):
            os.environ.pop(name, None)
        self.tmp = tempfile.mkdtemp(prefix="numa_utils_xpu_test_")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.trees = 0

    def host(self, *pci):
        self.trees += 1
        root = os.path.join(self.tmp, f"sys{self.trees}")
        write_sysfs(root, {0: {0}, 1: {1}, 2: {2}, 3: {3}}, pci)
        seam = patch.object(topology, "SYSFS_ROOT", root)
        seam.start()
        self.addCleanup(seam.stop)

    def nodes(self, count):
        """The node list of logical XPU devices 0..count-1."""
        return [_query_numa_node_for_gpu(device) for device in range(count)]


class TestListXpuPciAddresses(_XpuHostCase):
    """Which Intel GPUs there are.

    Unlike 0.5.23, they come from the sysfs PCI tree (vendor 0x8086, a display
    or accelerator class), not from /dev/dri render nodes: placement reads one
    tree, which can be a snapshot of another host, and opens no device.
    """

    def test_finds_intel_gpus_only(self):
        self.host(GPU_C, *NOT_GPUS, GPU_A)
        self.assertEqual(self.nodes(2), [[1], [3]])

    def test_no_intel_gpu_skips_with_warning(self):
        self.host(*NOT_GPUS)
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            self.assertEqual(_query_numa_node_for_gpu(0), [])
        self.assertTrue(any("0 Intel GPU(s)" in msg for msg in cm.output), cm.output)


class TestLevelZeroOrder(_XpuHostCase):
    """Level Zero's device order: PCI order, integrated GPU last unless
    ZE_ENABLE_PCI_ID_DEVICE_ORDER is set and not "0"."""

    def test_integrated_gpu_last_by_default(self):
        self.host(IGPU, GPU_B, GPU_A)
        self.assertEqual(self.nodes(3), [[1], [2], [0]])

    def test_pci_id_device_order_puts_integrated_first(self):
        self.host(IGPU, GPU_B, GPU_A)
        os.environ["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] = "1"
        self.assertEqual(self.nodes(3), [[0], [1], [2]])

    def test_pci_id_device_order_zero_is_unset(self):
        self.host(IGPU, GPU_B, GPU_A)
        os.environ["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] = "0"
        self.assertEqual(self.nodes(3), [[1], [2], [0]])


class TestZeAffinityMask(_XpuHostCase):
    """ZE_AFFINITY_MASK filters devices; unlike CUDA_VISIBLE_DEVICES it does
    not reorder them."""

    def setUp(self):
        super().setUp()
        self.host(IGPU, GPU_A, GPU_B, GPU_C)  # devices 0..3: A, B, C, integrated

    def test_mask_filters_and_keeps_order(self):
        os.environ["ZE_AFFINITY_MASK"] = "2,0"
        self.assertEqual(self.nodes(2), [[1], [3]])

    def test_subdevice_entries_name_their_card(self):
        os.environ["ZE_AFFINITY_MASK"] = "3,1.1,1.0"
        self.assertEqual(self.nodes(2), [[2], [0]])

    def test_bad_entries_are_skipped(self):
        os.environ["ZE_AFFINITY_MASK"] = "gpu0,2,,9,1.x"
        self.assertEqual(_query_numa_node_for_gpu(0), [3])
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            self.assertEqual(_query_numa_node_for_gpu(1), [])
        self.assertTrue(any("makes 1 device(s) visible" in m for m in cm.output))

    def test_empty_or_default_mask_shows_every_device(self):
        for mask in ("", "default"):
            os.environ["ZE_AFFINITY_MASK"] = mask
            self.assertEqual(self.nodes(4), [[1], [2], [3], [0]])


class TestXpuVisiblePciAddresses(_XpuHostCase):
    """The device list the runtime numbers: Level Zero may leave an integrated
    GPU out of it.

    0.5.23 compared its list with torch.xpu.device_count() and retried without
    integrated GPUs. No runtime is asked here; since the integrated GPU comes
    last, the discrete GPUs keep their numbers whether it is listed or not.
    """

    def test_integrated_gpu_left_out_keeps_discrete_numbers(self):
        self.host(GPU_A, GPU_B, GPU_C)
        without = self.nodes(3)
        self.host(IGPU, GPU_A, GPU_B, GPU_C)
        self.assertEqual(self.nodes(3), without)
        self.assertEqual(without, [[1], [2], [3]])

    def test_device_beyond_the_list_has_no_node(self):
        self.host(GPU_A, GPU_B)
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            self.assertEqual(_query_numa_node_for_gpu(2), [])
        self.assertTrue(any("2 Intel GPU(s)" in msg for msg in cm.output), cm.output)


class TestReadPciNumaNode(_XpuHostCase):
    """The node is the device's PCI numa_node; -1 means none."""

    def test_reads_the_devices_node(self):
        self.host(GPU_B)
        self.assertEqual(_query_numa_node_for_gpu(0), [2])

    def test_minus_one_means_no_node(self):
        self.host(("0000:29:00.0", -1, INTEL, "0x038000"))
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING"):
            self.assertEqual(_query_numa_node_for_gpu(0), [])


class TestGetNumaNodeIfAvailableXpu(_XpuHostCase):
    """get_numa_node_if_available on an XPU host with numactl."""

    def setUp(self):
        super().setUp()
        bindir = os.path.join(self.tmp, "bin")
        os.mkdir(bindir)
        numactl = os.path.join(bindir, "numactl")
        with open(numactl, "w") as f:
            f.write(
                '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n'
            )
        os.chmod(numactl, os.stat(numactl).st_mode | stat.S_IXUSR)
        os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
        os.environ["SGLANG_AUTO_NUMA_BIND"] = "1"
        self.host(IGPU, GPU_A, GPU_B, GPU_C)

    def test_node_of_the_masked_device(self):
        os.environ["ZE_AFFINITY_MASK"] = "1,2"
        self.assertTrue(_is_numa_available())
        args = SimpleNamespace(numa_node=None)
        self.assertEqual(get_numa_node_if_available(args, 0), 2)
        self.assertEqual(get_numa_node_if_available(args, 1), 3)

    def test_explicit_numa_node_wins(self):
        args = SimpleNamespace(numa_node=[3, 0])
        self.assertEqual(get_numa_node_if_available(args, 1), 0)


if __name__ == "__main__":
    unittest.main()
