"""A GPU's NUMA node where NVML cannot say: its PCI device's node in sysfs, under the
CUDA_VISIBLE_DEVICES in force; and --numa-node's one length check."""

import os
import shutil
import tempfile
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement import topology
from sglang.srt.placement.types import SettingError
from sglang.srt.utils import numa_utils
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

# GPUs 0-1 on node 0, 2-3 on node 1, in PCI order.
GPUS = ("0000:17:00.0", "0000:31:00.0", "0000:b1:00.0", "0000:ca:00.0")


def write_tree(root):
    files = {"devices/system/cpu/online": "0-1"}
    for n in (0, 1):
        files[f"devices/system/node/node{n}/cpulist"] = str(n)
        files[f"devices/system/node/node{n}/meminfo"] = f"Node {n} MemTotal: 1024 kB"
        cpu = f"devices/system/cpu/cpu{n}/topology"
        files.update({f"{cpu}/physical_package_id": str(n), f"{cpu}/core_id": "0"})
        files[f"{cpu}/thread_siblings_list"] = str(n)
    for i, address in enumerate(GPUS):
        base = f"bus/pci/devices/{address}"
        files.update({f"{base}/numa_node": str(i // 2), f"{base}/vendor": "0x10de"})
        files.update({f"{base}/device": "0x2330", f"{base}/class": "0x030200"})
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text + "\n")


class TestGpuNumaNode(CustomTestCase):
    def setUp(self):
        root = tempfile.mkdtemp(prefix="gpu_numa_node_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        write_tree(root)
        patchers = [
            patch.object(topology, "SYSFS_ROOT", root),
            patch.dict("sys.modules", {"pynvml": None}),  # no NVML: sysfs answers
            patch.object(numa_utils, "_is_cuda", True),
            patch.object(numa_utils, "_is_xpu", False),
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)
        self.args = SimpleNamespace(numa_node=None, device="cuda")

    @patch("shutil.which", return_value="/usr/bin/numactl")
    @patch.dict(
        os.environ, {"CUDA_VISIBLE_DEVICES": "2,0", "SGLANG_AUTO_NUMA_BIND": "1"}
    )
    def test_without_nvml_a_gpu_takes_its_pci_devices_node(self, _which):
        nodes = [numa_utils.get_numa_node_if_available(self.args, i) for i in (0, 1)]
        self.assertEqual(nodes, [1, 0])

    def test_a_short_numa_node_list_is_an_error_naming_the_setting(self):
        args = SimpleNamespace(numa_node=[0, 1], device="cuda")
        with self.assertRaisesRegex(SettingError, "--numa-node has 2 entries"):
            numa_utils.get_numa_node_if_available(args, 2)


if __name__ == "__main__":
    unittest.main()
