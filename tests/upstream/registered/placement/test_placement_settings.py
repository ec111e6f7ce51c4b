"""Placement's settings are read through envs and refused, by name, when unusable."""

import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.settings import PlacementPolicy, SettingError, listed_node
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestPlacementSettings(CustomTestCase):
    def test_the_policy_holds_the_settings_of_an_engine(self):
        settings = {
            "SGLANG_SET_CPU_AFFINITY": "1",
            "SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7",
        }
        server_args = SimpleNamespace(device="cpu", numa_node=None, tp_size=4)
        with patch.dict(os.environ, settings):
            policy = PlacementPolicy.from_env(server_args, launcher="mp")
        self.assertTrue(policy.set_cpu_affinity)
        self.assertEqual(policy.cpu_threads_bind, "0-3|4-7")
        self.assertEqual(policy.tp_per_node, 4)

    def test_numa_node_needs_an_entry_for_each_gpu_id(self):
        self.assertEqual(listed_node([0, 1], 1), 1)
        with self.assertRaisesRegex(SettingError, "--numa-node has 2 entries"):
            listed_node([0, 1], 2)

    def test_cpulists_parse_as_the_kernel_writes_them(self):
        self.assertEqual(parse_cpulist("0-3,8,10-14:2"), {0, 1, 2, 3, 8, 10, 12, 14})
        self.assertEqual(format_cpulist({0, 1, 2, 3, 8}), "0-3,8")
        with self.assertRaises(ValueError):
            parse_cpulist("3-1")


if __name__ == "__main__":
    unittest.main()
