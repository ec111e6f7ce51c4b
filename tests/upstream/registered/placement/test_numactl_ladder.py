"""numactl's probe ladder: --membind, then --preferred, then CPU only, each option set
probed once."""

import shutil
import unittest
from unittest.mock import patch

from sglang.srt.placement.numactl import NumactlProber
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

MEMBIND_REFUSED = "set_mempolicy: Invalid argument"


class TestNumactlLadder(unittest.TestCase):
    def setUp(self):
        self.calls = []

        def run(argv):  # a kernel that refuses hard memory binding
            self.calls.append(tuple(argv))
            refused = any(a.startswith("--membind") for a in argv)
            return MEMBIND_REFUSED if refused else None

        runner = patch("sglang.srt.placement.numactl.run_numactl", side_effect=run)
        runner.start()
        self.addCleanup(runner.stop)
        self.prober = NumactlProber(numactl_path="/usr/bin/numactl")

    def ladder(self):
        return self.prober.ladder(
            cpu_args=("--cpunodebind=1",),
            mem_policy="bind",
            mem_nodes=(1,),
            preferred_node=1,
        )

    def test_a_refused_membind_falls_back_to_preferred_with_upstreams_warning(self):
        outcome = self.ladder()
        self.assertTrue(outcome.ok)
        self.assertEqual(outcome.mem_policy, "preferred")
        self.assertEqual(outcome.args, ("--cpunodebind=1", "--preferred=1"))
        self.assertIn("falling back to soft preferred policy", outcome.reasons[0])
        self.assertIn(MEMBIND_REFUSED, outcome.reasons[0])

    def test_each_option_set_is_probed_once(self):
        self.ladder()
        self.ladder()
        numactl, true = "/usr/bin/numactl", shutil.which("true")
        self.assertEqual(
            self.calls,
            [
                (numactl, "--cpunodebind=1", "--membind=1", true),
                (numactl, "--cpunodebind=1", "--preferred=1", true),
            ],
        )


if __name__ == "__main__":
    unittest.main()
