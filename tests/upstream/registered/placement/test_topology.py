"""The host's NUMA nodes, CPUs and PCI devices, read from a sysfs tree
(placement.topology.SYSFS_ROOT on the live host)."""

import os
import shutil
import tempfile
import unittest

from sglang.srt.placement.topology import read_topology
from sglang.srt.placement.types import PlacementError
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


def write_tree(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


def two_nodes():
    """Nodes 0 and 2 (ids may be sparse) of two CPUs each, and a GPU whose node the
    kernel does not know."""
    files = {"devices/system/cpu/online": "0-3"}
    for cpu in range(4):
        base = f"devices/system/cpu/cpu{cpu}/topology"
        files[f"{base}/physical_package_id"] = str(cpu // 2)
        files[f"{base}/core_id"] = str(cpu % 2)
        files[f"{base}/thread_siblings_list"] = str(cpu)
    for node, cpus in ((0, "0-1"), (2, "2-3")):
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = cpus
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       1048576 kB"
        files[f"{base}/distance"] = "10 20" if node == 0 else "20 10"
    for address, numa_node in (("0000:17:00.0", "2"), ("0000:81:00.0", "-1")):
        base = f"bus/pci/devices/{address}"
        files[f"{base}/numa_node"] = numa_node
        files[f"{base}/vendor"] = "0x10de"
        files[f"{base}/device"] = "0x2330"
        files[f"{base}/class"] = "0x030200"
    return files


class TestReadTopology(CustomTestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="topology_test_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def test_nodes_cpus_and_devices(self):
        write_tree(self.root, two_nodes())
        topology = read_topology(self.root)
        self.assertEqual(topology.node_ids, (0, 2))
        self.assertEqual(topology.node(2).cpus, {2, 3})
        self.assertEqual(topology.node(2).memory_kb, 1048576)
        self.assertEqual(topology.pci_device("0000:17:00.0").numa_node, 2)
        self.assertIsNone(topology.pci_device("0000:81:00.0").numa_node)

    def test_a_file_that_does_not_parse_is_named(self):
        files = two_nodes()
        files["devices/system/node/node2/cpulist"] = "2-x"
        write_tree(self.root, files)
        with self.assertRaisesRegex(PlacementError, "node2/cpulist"):
            read_topology(self.root)


if __name__ == "__main__":
    unittest.main()
