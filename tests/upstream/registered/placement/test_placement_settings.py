"""Placement's settings are read through envs and refused, by name, when unusable."""

import os
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.settings import PlacementPolicy, SettingError, affinity_mode
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestPlacementSettings(unittest.TestCase):
    def test_affinity_mode_defaults_to_node_and_a_bad_value_is_named(self):
        with patch.dict(os.environ):
            os.environ.pop("SGLANG_NUMA_AFFINITY_MODE", None)
            self.assertEqual(affinity_mode(), "node")
            os.environ["SGLANG_NUMA_AFFINITY_MODE"] = "nodes"
            with self.assertRaisesRegex(
                SettingError, "SGLANG_NUMA_AFFINITY_MODE='nodes'"
            ):
                affinity_mode()

    def test_the_policy_holds_the_settings_of_a_cpu_engine(self):
        settings = {
            "SGLANG_NUMA_AFFINITY_MODE": "exclusive",
            "SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7",
        }
        server_args = SimpleNamespace(device="cpu", numa_node=None)
        with patch.dict(os.environ, settings):
            policy = PlacementPolicy.from_env(server_args, launcher="mp")
        self.assertEqual(policy.affinity_mode, "exclusive")
        self.assertEqual(policy.cpu_threads_bind, "0-3|4-7")

    def test_cpulists_parse_as_the_kernel_writes_them(self):
        self.assertEqual(parse_cpulist("0-3,8,10-14:2"), {0, 1, 2, 3, 8, 10, 12, 14})
        self.assertEqual(format_cpulist({0, 1, 2, 3, 8}), "0-3,8")
        with self.assertRaises(ValueError):
            parse_cpulist("3-1")


if __name__ == "__main__":
    unittest.main()
