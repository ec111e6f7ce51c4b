"""Placement's records: cpulists, a host's cores, the memory-policy ladder, and a
placement's one-line summary."""

import unittest

from sglang.srt.placement.cpulist import MAX_CPUS, format_cpulist, parse_cpulist
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    MemPolicy,
    ProcessPlacement,
    RankIdentity,
    Strategy,
    descend,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestPlacementTypes(CustomTestCase):
    def test_cpulists_round_trip_and_are_bounded(self):
        self.assertEqual(parse_cpulist("0-3, 8,10-14:2"), {0, 1, 2, 3, 8, 10, 12, 14})
        self.assertEqual(format_cpulist({0, 1, 2, 3, 8, 10}), "0-3,8,10")
        with self.assertRaisesRegex(ValueError, f"above .*{MAX_CPUS - 1}"):
            parse_cpulist(f"0-{10**40}")

    def test_cores_keep_smt_siblings_together(self):
        cpus = tuple(
            Cpu(c, 0, 0, c % 2, frozenset({c % 2, c % 2 + 2})) for c in range(4)
        )
        host = HostTopology("/sys", (), cpus, frozenset(range(4)))
        self.assertEqual(host.cores_within(frozenset(range(4))), [{0, 2}, {1, 3}])

    def test_the_ladder_stops_at_the_first_policy_accepted(self):
        refuse_bind = lambda policy: "EPERM" if policy is MemPolicy.BIND else None
        policy, refused = descend(MemPolicy.BIND, refuse_bind)
        self.assertIs(policy, MemPolicy.PREFERRED)
        self.assertEqual([r.why for r in refused], ["EPERM"])

    def test_a_placement_says_what_is_bound_and_why(self):
        placement = ProcessPlacement(
            RankIdentity(tp_rank=1),
            numa_node=1,
            cpus=frozenset({4, 5, 6}),
            mem_nodes=frozenset({1}),
            mem_policy=MemPolicy.BIND,
            strategy=Strategy.EXEC,
            reasons=("GPU 1's node",),
        )
        self.assertEqual(
            placement.summary, "node 1 CPUs 4-6 membind 1 via exec -- GPU 1's node"
        )
        self.assertFalse(ProcessPlacement(RankIdentity()).bound)


if __name__ == "__main__":
    unittest.main()
