"""The numactl command line Ray runs a scheduler actor's worker under passes a shell untouched."""

import unittest

from sglang.srt.scheduler_placement.ray_plan import py_executable
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestPyExecutable(unittest.TestCase):
    def test_numactl_options_and_absolute_paths_pass(self):
        argv = [
            "/usr/bin/numactl",
            "--cpunodebind=1",
            "--membind=1",
            "/usr/bin/python3",
        ]
        self.assertEqual(py_executable(argv), " ".join(argv))

    def test_anything_a_shell_would_expand_is_refused_by_name(self):
        for argv, named in (
            (
                ["/usr/bin/numactl", "--membind=1;rm", "/usr/bin/python3"],
                "--membind=1;rm",
            ),
            (["/usr/bin/numactl", "/opt/my python/bin/python"], "/opt/my python"),
            (["numactl", "/usr/bin/python3"], "numactl path"),
        ):
            with self.assertRaisesRegex(ValueError, named):
                py_executable(argv)


if __name__ == "__main__":
    unittest.main()
