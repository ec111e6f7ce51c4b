"""python -m sglang.srt.placement_tools plan: where each rank of this host will run,
and bad input named."""

import contextlib
import io
import json
import os
import unittest
from unittest.mock import patch

from sglang.srt.placement_tools.__main__ import main
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


class TestPlanCommand(unittest.TestCase):
    def test_one_json_entry_per_rank_with_its_cpus_and_why(self):
        cpu = min(os.sched_getaffinity(0))
        groups = {"SGLANG_CPU_OMP_THREADS_BIND": f"{cpu}|{cpu}"}
        with patch.dict(os.environ, groups):
            code, out, err = run("--device", "cpu", "--tp-size", "2", "--json")
        self.assertEqual(code, 0, err)
        ranks = json.loads(out)["ranks"]
        self.assertEqual([r["tp_rank"] for r in ranks], [0, 1])
        self.assertEqual([r["cpus"] for r in ranks], [str(cpu), str(cpu)])
        self.assertIn("shares CPU(s)", " ".join(ranks[0]["reasons"]))

    def test_bad_input_exits_2_with_one_line_naming_the_flag(self):
        code, _, err = run("--tp-size", "0")
        self.assertEqual(code, 2)
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertIn("--tp-size", err)


if __name__ == "__main__":
    unittest.main()
