"""verify compares what a rank observed of its binding with its placement, line by
line."""

import dataclasses
import unittest

from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.placement_tools.verify import differences, observe_self
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

UNBOUND = ProcessPlacement(
    RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0), reasons=("one NUMA node",)
)


class TestVerifyDifferences(unittest.TestCase):
    def test_an_unbound_rank_left_alone_matches(self):
        observed = observe_self()
        self.assertEqual(differences(UNBOUND, observed, unbound_cpus=observed.cpus), [])

    def test_an_unbound_rank_moved_off_the_launchers_cpus_is_reported(self):
        observed = dataclasses.replace(observe_self(), cpus=frozenset({0}))
        found = differences(UNBOUND, observed, unbound_cpus=frozenset({0, 1, 2}))
        self.assertEqual(len(found), 1)
        self.assertIn("expected for an unbound rank", found[0])


if __name__ == "__main__":
    unittest.main()
