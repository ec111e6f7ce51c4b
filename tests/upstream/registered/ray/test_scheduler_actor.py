"""What a Ray scheduler actor checks after binding itself, and the settings it gets from the driver."""

import os
import threading
import unittest

from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.scheduler_placement.ray_actors import forwarded_env
from sglang.srt.scheduler_placement.ray_rank import thread_mismatches
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


def in_process(cpus):
    unbound = ProcessPlacement.unbound(
        RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=0),
        reasons=(),
        launcher="ray",
        failure=False,
    )
    return unbound.replace(cpus=frozenset(cpus), strategy="in-process")


class TestSchedulerActorChecks(unittest.TestCase):
    def test_a_thread_left_outside_the_placement_is_reported(self):
        allowed = os.sched_getaffinity(0)
        if len(allowed) < 2:
            self.skipTest("needs a process allowed on two CPUs")
        self.assertEqual(thread_mismatches(in_process(allowed)), [])
        release = threading.Event()
        thread = threading.Thread(target=release.wait, args=(30,))
        thread.start()
        try:
            os.sched_setaffinity(thread.native_id, {min(allowed)})
            found = thread_mismatches(in_process(allowed))
        finally:
            release.set()
            thread.join(30)
        self.assertEqual(len(found), 1)
        self.assertIn(f"thread {thread.native_id}", found[0])

    def test_the_engines_placement_settings_follow_it_to_the_actor(self):
        environ = {
            "SGLANG_NUMA_AFFINITY_MODE": "socket",
            "SGLANG_SYSFS_ROOT": "/snapshots/driver",
            "HOME": "/root",
        }
        self.assertEqual(
            forwarded_env(environ), {"SGLANG_NUMA_AFFINITY_MODE": "socket"}
        )


if __name__ == "__main__":
    unittest.main()
