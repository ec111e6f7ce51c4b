"""The spawn's numactl ladder runs the numactl it was given: the one the placement
found, which the wrapper then execs."""

import shutil
import unittest

from sglang.srt.utils.numa_utils import _probe_numactl_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestNumactlProbe(CustomTestCase):
    @unittest.skipUnless(shutil.which("numactl"), "needs numactl")
    def test_the_given_numactl_accepts_node_0(self):
        args = "--cpunodebind=0 --membind=0"
        found = _probe_numactl_args(args, numactl=shutil.which("numactl"))
        self.assertIn(found[0], (args, "--cpunodebind=0 --preferred=0"))

    def test_a_numactl_that_cannot_run_fails_every_step_and_says_why(self):
        missing = "/nonexistent/numactl"
        args, error = _probe_numactl_args("--cpunodebind=0", numactl=missing)
        self.assertIsNone(args)
        self.assertIn(missing, error)


if __name__ == "__main__":
    unittest.main()
