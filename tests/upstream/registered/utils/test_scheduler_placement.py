"""One placement per scheduler rank: what configure_scheduler_process's placement step
(numa_utils.bind_scheduler_process) does in the rank, SGLANG_SET_CPU_AFFINITY=1 included.

Each rank runs in a fresh interpreter on a sysfs tree of two NUMA nodes that splits this
host's CPUs (placement's ``topology.SYSFS_ROOT`` seam), with GPUs 0-1 on node 0 and 2-3 on
node 1 named by ``--numa-node``."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import psutil

from sglang.srt.placement.share import upstream_slice
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

CPUS = sorted(os.sched_getaffinity(0))

RANK = textwrap.dedent(
    """
    import json, os, sys, types
    from sglang.srt.placement import topology
    from sglang.srt.utils import numa_utils

    topology.SYSFS_ROOT = sys.argv[1]
    args = types.SimpleNamespace(
        device="cuda", tp_size=2, pp_size=1, nnodes=1, numa_node=json.loads(sys.argv[2])
    )
    outcome = numa_utils.bind_scheduler_process(args, 2)
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)),
                      "strategy": outcome and outcome.placement.strategy}))
    """
)


def write_tree(root, node_cpus):
    files = {"devices/system/cpu/online": ",".join(map(str, sum(node_cpus, [])))}
    for node, cpus in enumerate(node_cpus):
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = ",".join(map(str, cpus))
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       1048576 kB"
        for cpu in cpus:
            top = f"devices/system/cpu/cpu{cpu}/topology"
            files[f"{top}/physical_package_id"] = str(node)
            files[f"{top}/core_id"] = files[f"{top}/thread_siblings_list"] = str(cpu)
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text + "\n")
    return root


@unittest.skipIf(len(CPUS) < 2, "needs two CPUs this process may use")
class TestSchedulerPlacement(CustomTestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="scheduler_placement_")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.two_nodes = write_tree(os.path.join(self.dir, "two"), [CPUS[:1], CPUS[1:]])
        self.one_node = write_tree(os.path.join(self.dir, "one"), [CPUS])

    def rank(self, tree, numa_node, **settings):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
        env.update(SGLANG_CRASH_ON_NUMA_BIND_FAILURE="0", **settings)
        done = subprocess.run(
            [sys.executable, "-c", RANK, tree, json.dumps(numa_node)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def test_a_spawned_rank_keeps_the_binding_its_launcher_gave_it(self):
        # The launcher bound GPU 2's rank to node 1's slice: nothing is applied again.
        out = self.rank(self.two_nodes, [0, 0, 1, 1], SGLANG_SET_CPU_AFFINITY="1")
        self.assertEqual(out, {"cpus": CPUS, "strategy": None})

    def test_the_legacy_bind_applies_the_ranks_slice_of_its_node(self):
        out = self.rank(
            self.two_nodes,
            [0, 0, 1, 1],
            SGLANG_SET_CPU_AFFINITY="1",
            SGLANG_NUMA_BIND_V2="0",
        )
        # GPUs 2 and 3 share node 1 (CPUs[1:]); GPU 2 takes the first half of it.
        node1 = CPUS[1:]
        self.assertEqual(out["strategy"], "v1")
        self.assertEqual(out["cpus"], node1[: max(1, (len(node1) + 1) // 2)])

    def test_without_a_node_set_cpu_affinity_keeps_upstreams_slice(self):
        out = self.rank(self.one_node, None, SGLANG_SET_CPU_AFFINITY="1")
        cores, cpus = psutil.cpu_count(logical=False), psutil.cpu_count()
        expected = upstream_slice(
            2, tp_per_node=2, physical_cores=cores, logical_cpus=cpus
        )
        self.assertEqual(out["strategy"], "cpu-affinity")
        self.assertEqual(out["cpus"], sorted(expected & set(CPUS)))


if __name__ == "__main__":
    unittest.main()
