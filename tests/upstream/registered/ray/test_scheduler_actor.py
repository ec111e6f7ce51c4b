"""A Ray scheduler actor places the GPU Ray gave it by Ray's id (its own
``CUDA_VISIBLE_DEVICES`` shows that GPU as index 0) and binds every thread there, on
a sysfs tree (``SGLANG_SYSFS_ROOT``) of two nodes with two NVIDIA GPUs each."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement.types import ProcessAffinity, RankIdentity
from sglang.srt.scheduler_placement.ray_rank import actor_placement
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

GPUS = ("0000:17:00.0", "0000:18:00.0", "0000:b1:00.0", "0000:b2:00.0")


def write_host(root, node_cpus):
    """Nodes 0 and 1 with the CPUs given (this process's own); GPUs 0 and 1 on node 0,
    2 and 3 on node 1."""
    cpus = sorted(c for group in node_cpus for c in group)
    files = {"devices/system/cpu/online": ",".join(map(str, cpus))}
    for cpu in cpus:
        base = f"devices/system/cpu/cpu{cpu}/topology"
        node = 0 if cpu in node_cpus[0] else 1
        files[f"{base}/physical_package_id"] = str(node)
        files[f"{base}/core_id"] = str(cpu)
        files[f"{base}/thread_siblings_list"] = str(cpu)
    for node, group in enumerate(node_cpus):
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = ",".join(map(str, sorted(group)))
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       1048576 kB"
        files[f"{base}/distance"] = "10 20" if node == 0 else "20 10"
    for index, address in enumerate(GPUS):
        base = f"bus/pci/devices/{address}"
        files[f"{base}/numa_node"] = str(index // 2)
        files[f"{base}/vendor"] = "0x10de"
        files[f"{base}/device"] = "0x2330"
        files[f"{base}/class"] = "0x030200"
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


class TestRayActorPlacement(unittest.TestCase):
    def setUp(self):
        self.allowed = sorted(os.sched_getaffinity(0))
        if len(self.allowed) < 2:
            self.skipTest("needs a process allowed on two CPUs, one per node")
        self.root = tempfile.mkdtemp(prefix="ray_actor_test_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.node1 = {self.allowed[-1]}
        write_host(self.root, (set(self.allowed[:-1]), self.node1))
        self.environ = {
            "SGLANG_SYSFS_ROOT": self.root,
            "CUDA_VISIBLE_DEVICES": "0",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }

    def test_the_node_is_that_of_rays_gpu_not_of_index_0(self):
        with patch.dict(os.environ, self.environ):
            placement = actor_placement(
                SimpleNamespace(device="cuda", tp_size=4),
                rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=3, gpu_id=3),
                assigned_gpus=["3"],
            )
        self.assertEqual((placement.pci, placement.numa_node), (GPUS[3], 1))
        self.assertEqual(placement.cpus, frozenset(self.node1))

    def test_the_actor_binds_every_thread_before_its_scheduler_exists(self):
        script = textwrap.dedent(
            """
            import os, threading
            from types import SimpleNamespace
            from sglang.srt.scheduler_placement.ray_rank import bind_scheduler_actor

            release = threading.Event()
            early = threading.Thread(target=release.wait, args=(30,))
            early.start()
            placement = bind_scheduler_actor(
                SimpleNamespace(device="cuda", tp_size=4),
                gpu_id=2, assigned_gpus=["2"], tp_rank=2, pp_rank=0, dp_rank=None,
            ).placement
            print(placement.numa_node, sorted(os.sched_getaffinity(early.native_id)))
            release.set()
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, **self.environ},
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.split()[0], "1")
        self.assertEqual(done.stdout.strip().split(" ", 1)[1], str(sorted(self.node1)))


class EightCpuHost(unittest.TestCase):
    """The tree's two nodes of four CPUs each (no SMT), all of which the process may
    use, whatever this host's own CPUs."""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="ray_actor_host_test_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        write_host(self.root, (set(range(4)), set(range(4, 8))))
        every = ProcessAffinity(
            cpus=frozenset(range(8)), mems=frozenset({0, 1}), source="test"
        )
        affinity = patch(
            "sglang.srt.placement.resolve.read_process_affinity", return_value=every
        )
        affinity.start()
        self.addCleanup(affinity.stop)


class TestRayActorWithoutRaysIds(EightCpuHost):
    """Given no id by Ray, an actor's gpu_id indexes the CUDA_VISIBLE_DEVICES it has,
    as a spawned rank's does."""

    def test_the_visible_devices_name_the_gpu(self):
        environ = {
            "SGLANG_SYSFS_ROOT": self.root,
            "CUDA_VISIBLE_DEVICES": "2,3",
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        with patch.dict(os.environ, environ):
            placement = actor_placement(
                SimpleNamespace(device="cuda", tp_size=2),
                rank=RankIdentity(0, 0, 1, 1),
                assigned_gpus=[],
            )
        self.assertEqual((placement.pci, placement.numa_node), (GPUS[3], 1))
        self.assertEqual(placement.cpus, frozenset(range(4, 8)))


class TestRayActorAffinityModes(EightCpuHost):
    """Each actor computes its own GPU's share of the node alone, from sysfs: four
    cores per node (no SMT) between the node's two GPUs, in PCI order."""

    def place(self, gpu_id, mode):
        environ = {
            "SGLANG_SYSFS_ROOT": self.root,
            "SGLANG_NUMA_AFFINITY_MODE": mode,
            "CUDA_VISIBLE_DEVICES": str(gpu_id),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
        with patch.dict(os.environ, environ):
            return actor_placement(
                SimpleNamespace(device="cuda", tp_size=4),
                rank=RankIdentity(0, 0, gpu_id, gpu_id),
                assigned_gpus=[str(gpu_id)],
            )

    def test_exclusive_gives_each_actor_its_gpus_half_of_the_node(self):
        shares = [self.place(gpu_id, "exclusive") for gpu_id in range(4)]
        self.assertEqual(
            [sorted(p.cpus) for p in shares], [[0, 1], [2, 3], [4, 5], [6, 7]]
        )
        self.assertEqual([p.mem_nodes for p in shares], [{0}, {0}, {1}, {1}])
        self.assertFalse(any(p.degraded for p in shares))
        self.assertIn("GPU 2 of 2 on node 1", "; ".join(shares[3].reasons))

    def test_node_mode_binds_the_whole_node(self):
        self.assertEqual(self.place(3, "node").cpus, frozenset(range(4, 8)))


if __name__ == "__main__":
    unittest.main()
