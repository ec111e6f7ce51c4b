"""A running process binds itself: every thread's CPUs, not only the calling one's."""

import os
import threading
import unittest

from sglang.srt.placement.apply import set_all_threads_affinity
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestSetAllThreadsAffinity(CustomTestCase):
    def test_a_thread_started_before_the_bind_is_moved_too(self):
        allowed = os.sched_getaffinity(0)
        one = {min(allowed)}
        release = threading.Event()
        started = threading.Event()

        def wait():
            started.set()
            release.wait(30)

        thread = threading.Thread(target=wait)
        thread.start()
        started.wait(30)
        try:
            moved, refused = set_all_threads_affinity(frozenset(one))
            self.assertEqual((moved >= 2, refused), (True, None))
            self.assertEqual(os.sched_getaffinity(thread.native_id), one)
            self.assertEqual(os.sched_getaffinity(0), one)
        finally:
            set_all_threads_affinity(frozenset(allowed))
            release.set()
            thread.join(30)
        self.assertEqual(os.sched_getaffinity(0), allowed)


if __name__ == "__main__":
    unittest.main()
