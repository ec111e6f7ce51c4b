"""Where one rank runs, decided once from the host's answers and the settings."""

import unittest

from sglang.srt.placement.facts import FactsHost
from sglang.srt.placement.resolve import resolve_placement
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import (
    Cpu,
    DeviceIndex,
    DeviceRef,
    HostTopology,
    NumaNode,
    PciDevice,
    ProcessAffinity,
    RankIdentity,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

# Four GPUs in PCI order: two on node 0, two on node 1, and one the kernel cannot place.
GPUS = ("0000:17:00.0", "0000:18:00.0", "0000:b1:00.0", "0000:b2:00.0")
UNKNOWN_NODE = "0000:ca:00.0"


def two_nodes(gpus=GPUS):
    """Two nodes of four CPUs each (two cores of two SMT threads)."""
    nodes = tuple(
        NumaNode(node, frozenset(range(4 * node, 4 * node + 4)), 1 << 24)
        for node in (0, 1)
    )
    cpus = tuple(
        Cpu(cpu, cpu // 4, cpu // 4, (cpu % 4) // 2, frozenset({cpu, cpu ^ 1}))
        for cpu in range(8)
    )
    node = {pci: i // 2 for i, pci in enumerate(GPUS)}
    devices = tuple(
        PciDevice(pci, node.get(pci), "0x10de", "0x2330", "0x030200") for pci in gpus
    )
    return HostTopology("/fake/sys", nodes, cpus, frozenset(range(8)), devices)


def place(gpu_id, *, launcher="mp", numa_nodes=None, env=None, **settings):
    host = FactsHost(
        topology=two_nodes((*GPUS, UNKNOWN_NODE)),
        affinity=ProcessAffinity(frozenset(range(8)), frozenset({0, 1}), "test"),
        numa_nodes=numa_nodes,
        env=env or {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
    )
    policy = PlacementPolicy(
        launcher=launcher, device="cuda", numa_nodes=numa_nodes, **settings
    )
    gpu = DeviceRef(DeviceIndex.LOGICAL_GPU, gpu_id)
    return resolve_placement(rank=RankIdentity(gpu), policy=policy, host=host)


class TestResolvePlacement(CustomTestCase):
    def test_a_gpu_binds_to_its_node_under_numactl(self):
        placement = place(2)
        self.assertEqual((placement.numa_node, placement.strategy), (1, "exec"))
        self.assertEqual(placement.cpus, frozenset(range(4, 8)))
        self.assertEqual(placement.numactl_args, ("--cpunodebind=1", "--membind=1"))

    def test_cuda_visible_devices_names_the_gpu(self):
        placement = place(0, env={"CUDA_VISIBLE_DEVICES": "3,0"})
        self.assertEqual((placement.pci, placement.numa_node), (GPUS[3], 1))

    def test_a_gpu_whose_node_is_unknown_stays_unbound_and_says_why(self):
        placement = place(4)
        self.assertFalse(placement.bound)
        self.assertTrue(any("numa_node -1" in r for r in placement.reasons))

    def test_set_cpu_affinity_gives_each_gpu_its_slice_of_its_node(self):
        slices = [place(i, set_cpu_affinity=True).cpus for i in range(4)]
        self.assertEqual(slices, [{0, 1}, {2, 3}, {4, 5}, {6, 7}])
        placement = place(2, set_cpu_affinity=True)
        self.assertEqual(placement.numactl_args, ("--physcpubind=4,5", "--membind=1"))
        self.assertTrue(
            any("SGLANG_SET_CPU_AFFINITY=1" in r for r in placement.reasons)
        )

    def test_numa_node_picks_the_node_and_set_cpu_affinity_the_slice_within_it(self):
        placement = place(3, numa_nodes=(1, 1, 0, 1), set_cpu_affinity=True)
        # GPUs 0, 1 and 3 share node 1: GPU 3 is the third.
        self.assertEqual((placement.numa_node, placement.cpus), (1, {7}))

    def test_the_legacy_bind_applies_the_slice_with_preferred_memory(self):
        placement = place(2, bind_v2=False, set_cpu_affinity=True)
        self.assertEqual((placement.strategy, placement.cpus), ("v1", {4, 5}))
        self.assertEqual(placement.mem_policy, "preferred")

    def test_a_ray_actor_binds_itself_with_strict_memory(self):
        placement = place(2, launcher="ray")
        self.assertEqual(
            (placement.strategy, placement.mem_policy), ("in-process", "bind")
        )

    def test_without_a_node_set_cpu_affinity_keeps_upstreams_numa_blind_slice(self):
        placement = place(4, set_cpu_affinity=True, tp_per_node=4)
        # 4 physical cores (8 CPUs) / 4 GPUs: GPU 4 wraps to core 0, with its sibling.
        self.assertEqual((placement.strategy, placement.cpus), ("cpu-affinity", {0, 4}))


if __name__ == "__main__":
    unittest.main()
