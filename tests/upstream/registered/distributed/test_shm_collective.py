"""Bootstrap's CPU path hands the kernel a segment namespace per engine and pipeline
stage, and unlinks it.

The CPU build of sgl_kernel is not installed here: its ``initialize`` op is
registered with torch.library under the same name and schema, and records the
namespace it is given.
"""

import os
import unittest

import torch

from sglang.srt.distributed.shm_collective import (
    SHM_DIR,
    ShmNamespace,
    start_shm_collective,
    unlink_shm_segments,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CALLS = []


def register_initialize():
    if hasattr(torch.ops.sgl_kernel, "initialize"):
        return None
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    library.define("initialize(int size, int rank, str namespace) -> ()")
    library.impl(
        "initialize",
        lambda size, rank, namespace: CALLS.append((size, rank, namespace)),
        "CompositeExplicitAutograd",
    )
    return library


class TestStartShmCollective(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.library = register_initialize()
        if cls.library is None:
            raise unittest.SkipTest("a real sgl_kernel initialize op is registered")

    def tearDown(self):
        unlink_shm_segments()
        CALLS.clear()

    def test_each_engine_and_stage_gets_its_own_namespace(self):
        before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        for method, pp_rank in (
            ("tcp://127.0.0.1:29500", 0),
            ("tcp://127.0.0.1:29600", 0),
            ("tcp://127.0.0.1:29600", 1),
        ):
            started = start_shm_collective(
                dist_init_method=method, tp_size=1, tp_rank=0, pp_rank=pp_rank
            )
            self.assertTrue(started)
        prefixes = [namespace for _, _, namespace in CALLS]
        self.assertEqual(len(set(prefixes)), 3)
        expected = ShmNamespace.from_init_method("tcp://127.0.0.1:29500").prefix
        self.assertEqual(prefixes[0], expected)
        after = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        self.assertEqual(before, after)

    def test_once_every_rank_has_mapped_it_no_segment_is_left(self):
        method = "tcp://127.0.0.1:29700"
        start_shm_collective(dist_init_method=method, tp_size=1, tp_rank=0, pp_rank=0)
        name = ShmNamespace.from_init_method(method, pp_rank=0).segment_name(0)
        segment = os.path.join(SHM_DIR, name)
        self.assertTrue(os.path.exists(segment))
        self.assertEqual(unlink_shm_segments(), [segment])
        self.assertFalse(os.path.exists(segment))


if __name__ == "__main__":
    unittest.main()
