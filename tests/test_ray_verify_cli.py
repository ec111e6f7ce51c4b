"""``verify --launcher ray`` as a command: an engine over two Ray nodes, a cluster of its own, and its refusals.

In the two-node cluster (two raylets on this host, two GPUs each) each raylet
has its own fake /sys (SGLANG_SYSFS_ROOT) whose GPUs sit at PCI addresses only
that node has, so a rank planned from the wrong node's tree, or from the
driver's, would name a GPU its node does not hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from ray_gpu_cluster import ray_test_env, run_json, running_cluster

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    with running_cluster("0,1", "2,3") as cluster:
        yield cluster


def test_every_rank_is_planned_on_its_node_and_names_a_gpu_of_that_node(two_nodes):
    status, out, err = run_json(["-m", "sglang.srt.placement", "verify", "--launcher", "ray", "--device", "cuda",
                                 "--tp-size", "4", "--nnodes", "2", "--json", "--timeout", "90"],
                                env={**two_nodes["env"], "SGLANG_SYSFS_ROOT": "/nonexistent/driver/sys"})
    assert status == 0, err[-4000:]
    rows = out["ranks"]
    gpus_of = {node["node_id"]: node["gpus"] for node in two_nodes["nodes"]}
    assert [r["tp_rank"] for r in rows] == [0, 1, 2, 3]
    planned_on = []
    for r in rows:
        (where,) = [why for why in r["reasons"] if why.startswith("resolved on Ray node ")]
        node = where.removeprefix("resolved on Ray node ")
        planned_on.append(node)
        # The node is one of the cluster's (verify joined it), its tree holds the rank's GPU, and the actor
        # ran there: a rank on another node than its plan would be a difference, and the row not ok.
        assert r["pci"] in gpus_of[node], (r["pci"], node)
        assert r["ok"] and r["strategy"] == "exec", r
    assert sorted(planned_on) == sorted(list(gpus_of) * 2)
    assert sorted(r["pci"] for r in rows) == sorted(sum(gpus_of.values(), []))


def test_verify_with_ray_refuses_a_driver_side_sysfs_root_without_starting_ray(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sglang.srt.placement", "verify", "--launcher", "ray",
                           "--sysfs-root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "with --launcher ray each node plans from its own host facts; drop --sysfs-root" in done.stderr


def test_verify_without_ray_address_starts_a_local_cluster_and_stops_it():
    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    env = ray_test_env(directory)
    try:
        status, out, err = run_json(["-m", "sglang.srt.placement", "verify", "--launcher", "ray", "--device", "cpu",
                                     "--json", "--timeout", "90"], env=env)
        assert status == 0, err[-4000:]
        (row,) = out["ranks"]
        assert row["launcher"] == "ray" and row["ok"]
        # The cluster it started is gone: no process of that session (raylet, GCS, workers) stays running.
        sessions = os.path.join(directory, "ray")
        deadline = time.monotonic() + 15
        while (leftover := subprocess.run(["pgrep", "-f", sessions], capture_output=True, text=True).stdout.split()):
            assert time.monotonic() < deadline, f"processes of the cluster verify started are still running: {leftover}"
            time.sleep(0.2)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
