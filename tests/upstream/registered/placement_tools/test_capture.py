"""capture copies what placement reads of a host, so that plan can run on another host
from it."""

import os
import shutil
import tempfile
import unittest

from sglang.srt.placement.topology import read_topology
from sglang.srt.placement_tools.capture import capture_sysfs
from sglang.srt.placement_tools.verify import observe_self, parse_numa_maps
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestCaptureAndReadBack(unittest.TestCase):
    def test_a_snapshot_reads_as_the_host_it_was_taken_from(self):
        dest = os.path.join(tempfile.mkdtemp(prefix="capture_test_"), "snapshot")
        self.addCleanup(shutil.rmtree, os.path.dirname(dest), ignore_errors=True)
        self.assertGreater(capture_sysfs(dest, root="/sys"), 0)
        live, snapshot = read_topology("/sys"), read_topology(dest)
        self.assertEqual(snapshot.nodes, live.nodes)
        self.assertEqual(snapshot.online_cpus, live.online_cpus)

    def test_resident_memory_per_node_from_numa_maps(self):
        maps = (
            "7f00 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
            "7f10 default file=/lib/x.so mapped=4 N1=4 kernelpagesize_kB=4\n"
        )
        self.assertEqual(parse_numa_maps(maps), ({0: 8, 1: 20}, {0: 8, 1: 4}))

    def test_this_process_reads_its_own_binding(self):
        self.assertEqual(observe_self().cpus, os.sched_getaffinity(0))


if __name__ == "__main__":
    unittest.main()
