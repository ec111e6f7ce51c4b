"""A rank owns its shared-memory segment: what a dead run left is removed, and released at exit."""

import os
import shutil
import tempfile
import unittest

from sglang.srt.distributed.shm_namespace import ShmNamespace
from sglang.srt.distributed.shm_segments import claim_segment, release_shm_collective
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="base-a-test-cpu")


class TestShmSegments(unittest.TestCase):
    def setUp(self):
        self.shm_dir = tempfile.mkdtemp(prefix="shm_segments_test_")
        self.addCleanup(shutil.rmtree, self.shm_dir, ignore_errors=True)
        self.namespace = ShmNamespace("127.0.0.1", 29500)

    def test_a_leftover_segment_is_removed_when_its_rank_claims_it(self):
        leftover = os.path.join(self.shm_dir, self.namespace.segment_name(0))
        with open(leftover, "wb") as f:
            f.write(b"from a run that crashed")
        claim_segment(self.namespace, rank=0, shm_dir=self.shm_dir)
        self.addCleanup(release_shm_collective, self.namespace)
        self.assertFalse(os.path.exists(leftover))

    def test_release_names_the_segments_this_process_owned(self):
        claim_segment(self.namespace, rank=1, shm_dir=self.shm_dir)
        released = release_shm_collective(self.namespace, rank=1)
        self.assertEqual(released, [self.namespace.segment_name(1)])
        self.assertEqual(release_shm_collective(self.namespace, rank=1), [])


if __name__ == "__main__":
    unittest.main()
