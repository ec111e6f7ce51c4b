"""Each engine's CPU shared-memory segments are named by its own init address, never
by MASTER_ADDR/PORT."""

import os
import unittest
from unittest import mock

from sglang.srt.distributed.shm_namespace import ShmCollectiveError, ShmNamespace
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestShmNamespace(unittest.TestCase):
    def test_two_engines_on_one_host_never_share_a_segment_name(self):
        first = ShmNamespace.from_init_method("tcp://127.0.0.1:29500")
        second = ShmNamespace.from_init_method("tcp://127.0.0.1:29600")
        self.assertEqual((first.addr, first.port), ("127.0.0.1", 29500))
        self.assertNotEqual(first.segment_name(0), second.segment_name(0))

    def test_env_init_reads_master_addr_from_the_environment(self):
        environ = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29501"}
        with mock.patch.dict(os.environ, environ):
            namespace = ShmNamespace.from_init_method("env://")
        self.assertEqual((namespace.addr, namespace.port), ("10.0.0.7", 29501))

    def test_an_address_a_segment_name_cannot_hold_is_refused_with_the_fix(self):
        with self.assertRaisesRegex(ShmCollectiveError, "--dist-init-addr"):
            ShmNamespace("h" * 250, 29500)
        with self.assertRaisesRegex(ShmCollectiveError, "contains '/'"):
            ShmNamespace("a/b", 29500)


if __name__ == "__main__":
    unittest.main()
