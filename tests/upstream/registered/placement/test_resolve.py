"""Where one rank runs, decided from host facts and the policy alone."""

import unittest
from unittest.mock import patch

from sglang.srt.placement.numactl import NumactlProber
from sglang.srt.placement.resolve import HostCapabilities, HostFacts, resolve_placement
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import (
    Accelerator,
    Cpu,
    HostTopology,
    NumaNode,
    PciDevice,
    ProcessAffinity,
    RankIdentity,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

ON_NODE_1 = "0000:b1:00.0"
UNKNOWN_NODE = "0000:ca:00.0"
ALSO_ON_NODE_1 = "0000:b2:00.0"


def two_nodes(gpus=(ON_NODE_1, UNKNOWN_NODE)):
    """Two nodes of four CPUs (two cores of two threads each), a GPU on node 1 and one
    whose node the kernel does not know."""
    nodes = tuple(
        NumaNode(node, frozenset(range(4 * node, 4 * node + 4)), 1 << 24)
        for node in (0, 1)
    )
    cpus = tuple(
        Cpu(cpu, cpu // 4, cpu // 4, (cpu % 4) // 2, frozenset({cpu, cpu ^ 1}))
        for cpu in range(8)
    )
    node = {ON_NODE_1: 1, ALSO_ON_NODE_1: 1}
    devices = tuple(
        PciDevice(pci, node.get(pci), "0x10de", "0x2330", "0x030200") for pci in gpus
    )
    return HostTopology("/fake/sys", nodes, cpus, frozenset(range(8)), devices)


def place(pci, *, gpu_id=1, mode="node", topology=None):
    topology = topology or two_nodes()
    prober = NumactlProber(numactl_path="numactl")
    facts = HostFacts(
        topology=topology,
        affinity=ProcessAffinity(
            frozenset(range(8)), frozenset({0, 1}), "this process"
        ),
        capabilities=HostCapabilities(numactl=prober, libnuma=True),
    )
    # A kernel that accepts every numactl option set.
    with patch("sglang.srt.placement.numactl.run_numactl", return_value=None):
        return resolve_placement(
            facts=facts,
            rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=gpu_id, gpu_id=gpu_id),
            accelerator=Accelerator(gpu_id, str(gpu_id), pci, "sysfs"),
            policy=PlacementPolicy(launcher="mp", device="cuda", affinity_mode=mode),
        )


class TestResolvePlacement(unittest.TestCase):
    def test_a_gpu_binds_to_its_node_under_numactl(self):
        placement = place(ON_NODE_1)
        self.assertEqual(placement.numa_node, 1)
        self.assertEqual(placement.cpus, frozenset(range(4, 8)))
        self.assertEqual(placement.numactl_args, ("--cpunodebind=1", "--membind=1"))
        self.assertEqual(placement.strategy, "exec")

    def test_a_gpu_whose_node_is_unknown_stays_unbound_and_says_why(self):
        placement = place(UNKNOWN_NODE)
        self.assertFalse(placement.bound)
        self.assertTrue(any(UNKNOWN_NODE in r for r in placement.reasons))

    def test_exclusive_gives_each_gpu_of_a_node_its_cores_smt_siblings_together(self):
        topology = two_nodes(gpus=(ON_NODE_1, ALSO_ON_NODE_1))
        slices = [
            place(pci, gpu_id=i, mode="exclusive", topology=topology).cpus
            for i, pci in enumerate((ON_NODE_1, ALSO_ON_NODE_1))
        ]
        self.assertEqual(slices, [{4, 5}, {6, 7}])


if __name__ == "__main__":
    unittest.main()
