"""A spawned scheduler's numactl wrapper: private (0700, in a 0700 directory), quoted,
exec'ing the numactl the placement probed, and removed once the child has started."""

import multiprocessing
import os
import shlex
import shutil
import stat
import unittest
from types import SimpleNamespace
from unittest.mock import patch

from sglang.srt.utils import numa_utils
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

CPUS = sorted(os.sched_getaffinity(0))


def report_cpus(writer):
    writer.send(sorted(os.sched_getaffinity(0)))


class TestNumaSpawnWrapper(CustomTestCase):
    @unittest.skipUnless(shutil.which("numactl"), "the spawn wrapper execs numactl")
    def test_the_spawn_wrapper_is_private_quoted_and_gone_after_the_start(self):
        args = SimpleNamespace(device="cpu", tp_size=2, numa_node=None)
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=report_cpus, args=(writer,))
        groups = {"SGLANG_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[-1]}"}
        with patch.dict(os.environ, groups), numa_utils.configure_subprocess(args, 1):
            wrapper = os.fsdecode(multiprocessing.spawn.get_executable())
            for path in (wrapper, os.path.dirname(wrapper)):
                self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o700)
            with open(wrapper) as f:
                words = shlex.split(f.read().splitlines()[1])
            numactl = shutil.which("numactl")
            self.assertEqual(words[1:3], [numactl, f"--physcpubind={CPUS[-1]}"])
            proc.start()
        writer.close()
        self.assertEqual(reader.recv(), [CPUS[-1]])
        proc.join(30)
        self.assertFalse(os.path.exists(os.path.dirname(wrapper)))


if __name__ == "__main__":
    unittest.main()
