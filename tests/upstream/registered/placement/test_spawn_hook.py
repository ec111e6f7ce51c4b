"""A spawned scheduler starts under a prefix (numactl) on its command line, and only a
spawned child does."""

import multiprocessing
import multiprocessing.spawn
import os
import sys
import unittest

from sglang.srt.scheduler_placement import spawn
from sglang.srt.scheduler_placement.spawn import is_spawned_child, spawn_with_prefix
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

MARK = "SGLANG_SPAWN_HOOK_TEST_MARK"


def exit_with_mark():
    """In the child: exit 0 only when it was started through the prefix."""
    sys.exit(0 if os.environ.get(MARK) == "1" else 3)


def start(target):
    proc = multiprocessing.get_context("spawn").Process(target=target)
    proc.start()
    proc.join(60)
    return proc.exitcode


class TestSpawnHook(unittest.TestCase):
    def test_only_the_spawn_command_line_is_a_spawned_child(self):
        self.assertTrue(is_spawned_child(multiprocessing.spawn.get_command_line()))
        forkserver = [
            sys.executable,
            "-c",
            "from multiprocessing.forkserver import main",
        ]
        self.assertFalse(is_spawned_child(forkserver))

    def test_a_child_spawned_inside_the_block_runs_under_the_prefix(self):
        os.environ.pop(MARK, None)
        with spawn_with_prefix(["/usr/bin/env", f"{MARK}=1"]):
            self.assertEqual(spawn._state.use.prefix, ("/usr/bin/env", f"{MARK}=1"))
            self.assertEqual(start(exit_with_mark), 0)
        self.assertIsNone(spawn._state.use)
        self.assertEqual(start(exit_with_mark), 3)


if __name__ == "__main__":
    unittest.main()
