"""sgl_kernel::initialize(size, rank, namespace, group, timeout): each group sets up
/dev/shm segments of its own; every rank returns, or every rank fails in time."""

import multiprocessing
import os
import secrets
import threading
import time
import unittest

import torch

try:
    import sgl_kernel  # noqa: F401
except ImportError as exc:
    raise unittest.SkipTest(f"no CPU build of sgl_kernel: {exc}")

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=60, suite="base-b-test-cpu")

SHM = "/dev/shm"
FORK = multiprocessing.get_context("fork")


def run_rank(results, name, size, rank, namespace, group, timeout, value, umask):
    """Joins the group, then sums [value, value + 1] over it, small and large."""
    os.umask(umask)
    started, sums = time.monotonic(), set()
    try:
        torch.ops.sgl_kernel.initialize(size, rank, namespace, group, timeout)
        for dtype, numel in ((torch.float32, 32), (torch.bfloat16, 1 << 20)):
            data = (torch.arange(numel) % 2 + value).to(dtype)
            torch.ops.sgl_kernel.shm_allreduce(data, torch.distributed.ReduceOp.SUM)
            sums.add(tuple(data[:2].tolist()))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    results.put((name, error, sums, time.monotonic() - started))


def call(messages, *args):
    try:
        torch.ops.sgl_kernel.initialize(*args)
        messages.put(None)
    except RuntimeError as exc:
        messages.put(str(exc))


def join_twice(messages, namespace, group):
    for other in (group, group, "other"):  # a group of one, again, then another
        call(messages, 1, 0, namespace, other, 3.0)


def join_from_two_threads(messages, namespace, group):
    first = threading.Thread(target=call, args=(messages, 2, 0, namespace, group, 3.0))
    first.start()  # rank 1 never comes: it waits
    while not os.path.exists(f"{SHM}/{namespace}_{group}_0"):
        time.sleep(0.01)
    call(messages, 1, 0, namespace, "other", 3.0)
    first.join()


def reduce_once_peer_exits(results, namespace, group, rank):
    torch.ops.sgl_kernel.initialize(2, rank, namespace, group, 3.0)
    if rank == 1:
        os._exit(0)  # gone once set up
    started = time.monotonic()
    try:
        torch.ops.sgl_kernel.shm_allreduce(
            torch.ones(8), torch.distributed.ReduceOp.SUM
        )
        error = None
    except RuntimeError as exc:
        error = str(exc)
    results.put(("0", error, None, time.monotonic() - started))


class TestShmGroup(CustomTestCase):
    def setUp(self):
        self.namespace = f"sgl_test_{os.getpid()}_{secrets.token_hex(4)}"
        self.results = FORK.Queue()
        self.addCleanup(lambda: [os.unlink(f"{SHM}/{n}") for n in self.left()])

    def start(self, name, size, rank, group, timeout=3.0, value=0, umask=0o022):
        args = (self.results, name, size, rank, self.namespace, group, timeout)
        process = FORK.Process(target=run_rank, args=(*args, value, umask))
        process.start()
        self.addCleanup(process.kill)
        return process

    def outcomes(self, count):
        found = [self.results.get(timeout=60) for _ in range(count)]
        return {name: outcome for name, *outcome in found}

    def left(self):
        return sorted(n for n in os.listdir(SHM) if n.startswith(self.namespace))

    def wait_until(self, condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)

    def test_two_groups_in_one_namespace_never_pair(self):
        a, b = secrets.token_hex(8), secrets.token_hex(8)
        # a0 and b1 first: named by the namespace alone, they would pair. The umask
        # would make their segments 0400, which peers other than root cannot open.
        self.start("a0", 2, 0, a, value=1, umask=0o277)
        self.start("b1", 2, 1, b, value=20, umask=0o277)
        self.wait_until(lambda: len(self.left()) == 2)
        self.assertEqual(
            {os.stat(f"{SHM}/{n}").st_mode & 0o777 for n in self.left()}, {0o600}
        )
        self.start("a1", 2, 1, a, value=2)
        self.start("b0", 2, 0, b, value=10)
        outcomes = self.outcomes(4)
        for name, sums in (("a0", 3), ("a1", 3), ("b0", 30), ("b1", 30)):
            self.assertEqual(outcomes[name][:2], [None, {(sums, sums + 2)}])
        self.assertEqual(self.left(), [])

    def test_a_segment_of_another_size_is_an_error_naming_both(self):
        group = secrets.token_hex(8)
        self.start("of 2", 2, 0, group)
        self.start("of 3", 3, 1, group)
        errors = " ".join(error for error, _, _ in self.outcomes(2).values())
        self.assertRegex(errors, rf"\(size [23]\) found {SHM}/{self.namespace}_{group}_"
                                 rf"\d of group '{self.namespace}_{group}' \(size [23],")  # fmt: skip
        self.assertEqual(self.left(), [])

    def test_a_rank_gone_after_counting_itself_in_fails_the_whole_group(self):
        group = secrets.token_hex(8)
        self.start("0", 3, 0, group)
        doomed = self.start("2", 3, 2, group)
        rank0 = f"{SHM}/{self.namespace}_{group}_0"
        self.wait_until(lambda: rank0 in open(f"/proc/{doomed.pid}/maps").read())
        doomed.kill()  # it mapped rank 0's segment; rank 1 has yet to come
        self.start("1", 3, 1, group)
        outcomes = self.outcomes(2)
        self.assertIn("rank 2", outcomes["0"][0] or "rank 0 returned")
        self.assertIsNotNone(outcomes["1"][0])
        self.assertLess(max(seconds for _, _, seconds in outcomes.values()), 5)
        self.assertEqual(self.left(), [])

    def test_out_of_range_arguments_are_refused(self):
        group, ns = secrets.token_hex(8), self.namespace
        for size, rank in ((2**32 + 2, 0), (2, 2**32), (2, -1), (0, 0), (2**16 + 1, 0)):
            with self.assertRaisesRegex(RuntimeError, f"size {size} and rank {rank}:"):
                torch.ops.sgl_kernel.initialize(size, rank, ns, group, 1.0)
        for args in ((ns, group, 0.0), (ns, group, float("nan")), ("a/b", group, 1.0),
                     (ns, "a_b", 1.0), (ns, "", 1.0), ("x" * 250, group, 1.0)):  # fmt: skip
            with self.assertRaises(RuntimeError):
                torch.ops.sgl_kernel.initialize(2, 0, *args)
        self.assertEqual(self.left(), [])

    def test_a_process_joins_one_group(self):
        messages = FORK.Queue()
        args = (messages, self.namespace, secrets.token_hex(8))
        FORK.Process(target=join_twice, args=args).start()
        found = [messages.get(timeout=60) for _ in range(3)]
        self.assertEqual(found[:2], [None, None])
        self.assertIn(f"also be rank 0 of group '{self.namespace}_other'", found[2])
        self.assertEqual(self.left(), [])

    def test_a_rank_gone_during_set_up_stops_its_peers_at_once(self):
        group = secrets.token_hex(8)
        self.start("0", 3, 0, group, timeout=60)
        doomed = self.start("2", 3, 2, group, timeout=60)
        rank0 = f"{SHM}/{self.namespace}_{group}_0"
        self.wait_until(lambda: rank0 in open(f"/proc/{doomed.pid}/maps").read())
        doomed.kill()
        [(error, _, seconds)] = self.outcomes(1).values()
        self.assertIn("rank 2 exited during set-up", error or "rank 0 returned")
        self.assertLess(seconds, 10)  # not the 60 s deadline
        self.assertEqual(self.left(), [])

    def test_the_next_launch_removes_what_a_killed_set_up_left(self):
        killed, group = secrets.token_hex(8), secrets.token_hex(8)
        doomed = self.start("killed", 2, 0, killed)
        self.wait_until(lambda: self.left() != [])
        doomed.kill()
        doomed.join()
        not_ours = f"{self.namespace}_{killed}_1"
        open(f"{SHM}/{not_ours}", "x").close()  # a name of the namespace, no segment
        self.start("0", 2, 0, group)
        self.start("1", 2, 1, group, value=1)
        self.assertEqual([e for e, _, _ in self.outcomes(2).values()], [None, None])
        self.assertEqual(self.left(), [not_ours])

    def test_a_collective_fails_when_a_peer_is_gone(self):
        group = secrets.token_hex(8)
        for rank in (0, 1):
            args = (self.results, self.namespace, group, rank)
            process = FORK.Process(target=reduce_once_peer_exits, args=args)
            process.start()
            self.addCleanup(process.kill)
        [(error, _, seconds)] = self.outcomes(1).values()
        self.assertIn("waits for rank 1, whose process is gone", error or "returned")
        self.assertLess(seconds, 10)

    def test_two_threads_of_a_process_cannot_both_join(self):
        messages = FORK.Queue()
        args = (messages, self.namespace, secrets.token_hex(8))
        FORK.Process(target=join_from_two_threads, args=args).start()
        found = [messages.get(timeout=60) for _ in range(2)]
        self.assertIn("another thread of this process", found[0])
        self.assertIn("waited 3 s for rank 1", found[1])
        self.assertEqual(self.left(), [])
