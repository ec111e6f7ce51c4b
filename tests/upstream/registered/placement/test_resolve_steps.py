"""The decision's steps on a host that answers from a table: the numactl ladder and
the failure policy."""

import unittest

from sglang.srt.placement.resolve import resolve_placement
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import (
    DeviceIndex,
    DeviceRef,
    HostTopology,
    NodeChoice,
    NumaNode,
    ProcessAffinity,
    RankIdentity,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

NODES = {0: frozenset(range(4)), 1: frozenset(range(4, 8))}


class Host:
    """GPU N on node N // 2; numactl accepts only what ``accepts`` lists."""

    numactl_path, libnuma = "/usr/bin/numactl", True

    def __init__(self, accepts):
        self.accepts, self.failures = accepts, []

    def topology(self):
        nodes = tuple(NumaNode(n, cpus, 1 << 20) for n, cpus in NODES.items())
        return HostTopology("/fake/sys", nodes, (), frozenset(range(8)))

    def affinity(self):
        return ProcessAffinity(frozenset(range(8)), frozenset(NODES), "test")

    def numa_node(self, rank):
        return NodeChoice(rank.device.index // 2, ("from the table",))

    def node_cpus(self, node):
        return NODES.get(node, frozenset())

    def can_set_mempolicy(self):
        return True

    def probe(self, args):
        ok = [
            a for a in (args, args.replace("membind", "preferred")) if a in self.accepts
        ]
        return (ok[0], "") if ok else (None, "set_mempolicy: Operation not permitted")

    def fail(self, node, reason):
        self.failures.append(reason)


def place(host):
    policy = PlacementPolicy(launcher="mp", device="cuda")
    rank = RankIdentity(DeviceRef(DeviceIndex.LOGICAL_GPU, 2))
    return resolve_placement(rank=rank, policy=policy, host=host)


class TestResolveSteps(CustomTestCase):
    def test_numactl_refusing_membind_gives_preferred_memory_and_says_so(self):
        placement = place(Host(accepts={"--cpunodebind=1 --preferred=1"}))
        self.assertEqual(placement.mem_policy, "preferred")
        self.assertTrue(placement.degraded)
        self.assertIn(
            "numactl refused '--cpunodebind=1 --membind=1'", placement.summary
        )

    def test_numactl_refusing_everything_leaves_the_rank_unbound_once(self):
        host = Host(accepts=set())
        placement = place(host)
        self.assertFalse(placement.bound)
        self.assertEqual(len(host.failures), 1)
        self.assertIn("Operation not permitted", host.failures[0])


if __name__ == "__main__":
    unittest.main()
