"""Bootstrap's CPU path hands the kernel a segment namespace per engine and pipeline
stage; with the released kernel, it creates and later unlinks each rank's segment.

The CPU build of sgl_kernel is not installed here: its ``initialize`` op is
registered with torch.library under the same name and schema, and records what it
is given.
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

MASTER = ("MASTER_ADDR", "MASTER_PORT")


class _FakeInitialize(unittest.TestCase):
    """Registers ``sgl_kernel::initialize`` with SCHEMA for the class's tests."""

    SCHEMA = ""

    @classmethod
    def setUpClass(cls):
        if hasattr(torch.ops.sgl_kernel, "initialize"):
            raise unittest.SkipTest("a real sgl_kernel initialize op is registered")
        cls.calls = []
        cls.library = torch.library.Library("sgl_kernel", "FRAGMENT")
        cls.library.define(cls.SCHEMA)
        record = lambda *args: cls.calls.append(  # noqa: E731
            (args, {k: os.environ.get(k) for k in MASTER})
        )
        cls.library.impl("initialize", record, "CompositeExplicitAutograd")

    @classmethod
    def tearDownClass(cls):
        cls.library._destroy()

    def tearDown(self):
        unlink_shm_segments()
        self.calls.clear()

    def start(self, method, pp_rank=0):
        before = {k: os.environ.get(k) for k in MASTER}
        started = start_shm_collective(
            dist_init_method=method, tp_size=1, tp_rank=0, pp_rank=pp_rank
        )
        self.assertTrue(started)
        self.assertEqual({k: os.environ.get(k) for k in MASTER}, before)
        namespace = ShmNamespace.from_init_method(method, pp_rank=pp_rank)
        return namespace, os.path.join(SHM_DIR, namespace.segment_name(0))


class TestNamespacedKernel(_FakeInitialize):
    SCHEMA = "initialize(int size, int rank, str namespace) -> ()"

    def test_each_engine_and_stage_gets_its_own_namespace(self):
        for method, pp_rank in (
            ("tcp://127.0.0.1:29500", 0),
            ("tcp://127.0.0.1:29600", 0),
            ("tcp://127.0.0.1:29600", 1),
        ):
            namespace, _ = self.start(method, pp_rank)
            self.assertEqual(self.calls[-1][0], (1, 0, namespace.prefix))
        self.assertEqual(len({args[2] for args, _ in self.calls}), 3)

    def test_this_side_creates_and_unlinks_nothing(self):
        _, segment = self.start("tcp://127.0.0.1:29700")
        self.assertFalse(os.path.exists(segment))
        self.assertEqual(unlink_shm_segments(), [])


class TestReleasedKernel(_FakeInitialize):
    SCHEMA = "initialize(int size, int rank) -> ()"

    def test_the_kernel_sees_the_namespace_only_during_the_call(self):
        namespace, _ = self.start("tcp://127.0.0.1:29800", pp_rank=1)
        [(args, seen)] = self.calls
        self.assertEqual(args, (1, 0))
        expected = {"MASTER_ADDR": namespace.kernel_addr, "MASTER_PORT": "29800"}
        self.assertEqual(seen, expected)

    def test_once_every_rank_has_mapped_it_no_segment_is_left(self):
        _, segment = self.start("tcp://127.0.0.1:29900")
        self.assertTrue(os.path.exists(segment))
        self.assertEqual(unlink_shm_segments(), [segment])
        self.assertFalse(os.path.exists(segment))


if __name__ == "__main__":
    unittest.main()
