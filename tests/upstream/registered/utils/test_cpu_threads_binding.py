"""A CPU-device rank's OpenMP CPUs (SGLANG_CPU_OMP_THREADS_BIND): errors that name the
setting, the value and the fix, in place of assertions."""

import os
import unittest
from unittest.mock import patch

from sglang.srt.placement.types import SettingError
from sglang.srt.utils.numa_utils import init_threads_binding
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

CPU = min(os.sched_getaffinity(0))


class TestCpuThreadsBinding(CustomTestCase):
    def bind(self, setting, index):
        with patch.dict(os.environ, {"SGLANG_CPU_OMP_THREADS_BIND": setting}):
            return init_threads_binding(numa_index=index, world_size=index + 1)

    def test_a_rank_gets_its_group(self):
        self.assertEqual(self.bind(f"{CPU}|{CPU}", 1), str(CPU))

    def test_a_rank_without_a_group_is_told_how_many_are_needed(self):
        with self.assertRaisesRegex(SettingError, r"has 2 group\(s\) but rank index 2"):
            self.bind(f"{CPU}|{CPU}", 2)

    def test_a_group_of_cpus_this_host_lacks_is_refused(self):
        with self.assertRaisesRegex(SettingError, "not online on this host"):
            self.bind("8190", 0)


if __name__ == "__main__":
    unittest.main()
