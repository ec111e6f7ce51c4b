"""The placement of the rank a GPU id names, as sglang's launchers will start it."""

import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement.resolve import HostCapabilities, HostFacts, place_gpu_id
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    NumaNode,
    PciDevice,
    ProcessAffinity,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

GPUS = ("0000:17:00.0", "0000:b1:00.0")


def facts():
    """Two nodes of four CPUs, one GPU on each; no numactl, libnuma present."""
    nodes = tuple(
        NumaNode(node, frozenset(range(4 * node, 4 * node + 4)), 1 << 24)
        for node in (0, 1)
    )
    cpus = tuple(
        Cpu(cpu, cpu // 4, cpu // 4, cpu % 4, frozenset({cpu})) for cpu in range(8)
    )
    devices = tuple(
        PciDevice(address, node, vendor="10de", pci_class="030200")
        for node, address in enumerate(GPUS)
    )
    return HostFacts(
        topology=HostTopology("/fake/sys", nodes, cpus, frozenset(range(8)), devices),
        affinity=ProcessAffinity(frozenset(range(8)), frozenset({0, 1}), "test"),
        capabilities=HostCapabilities(numactl=None, libnuma=True),
    )


def place(device, gpu_id, env):
    server_args = SimpleNamespace(device=device, tp_size=2)
    policy = PlacementPolicy.from_env(server_args, launcher="ray")
    return place_gpu_id(gpu_id, policy=policy, facts=facts(), env=env)


class TestPlaceGpuId(unittest.TestCase):
    def test_the_gpu_id_names_the_device_cuda_visible_devices_gives_it(self):
        placement = place("cuda", 0, {"CUDA_VISIBLE_DEVICES": "1,0"})
        self.assertEqual((placement.pci, placement.numa_node), (GPUS[1], 1))
        self.assertEqual(placement.cpus, frozenset(range(4, 8)))

    def test_a_cpu_rank_gets_its_group_of_sglang_cpu_omp_threads_bind(self):
        with patch.dict(os.environ, {"SGLANG_CPU_OMP_THREADS_BIND": "0-1|4-5"}):
            placement = place("cpu", 1, {})
        self.assertEqual(placement.cpus, frozenset({4, 5}))
        self.assertEqual(placement.numa_node, 1)


if __name__ == "__main__":
    unittest.main()
