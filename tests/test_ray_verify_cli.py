"""``verify --launcher ray`` as a command: an engine over two Ray nodes, a cluster of its own, and its refusals.

In the two-node cluster (two raylets on this host, two GPUs each) each raylet
has its own fake /sys (``ray_gpu_cluster.fake_host_env``) whose GPUs sit at PCI addresses only
that node has, all on NUMA node 0 with this host's CPUs (padded with CPUs it
lacks), so a rank planned from the wrong node's tree, or from the driver's,
would name a GPU its node does not hold. Each rank places itself on the node it
runs on. The command joins the cluster through RAY_ADDRESS.
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

VERIFY = ["-m", "sglang.srt.placement_tools", "verify", "--launcher", "ray", "--json"]


@pytest.fixture(scope="module")
def two_nodes():
    with running_cluster("0,1", "2,3") as cluster:
        yield cluster


def test_every_rank_places_itself_from_its_own_nodes_tree_and_binds_there(two_nodes):
    status, out, err = run_json(
        [
            *VERIFY,
            "--device",
            "cuda",
            "--tp-size",
            "4",
            "--nnodes",
            "2",
            "--timeout",
            "150",
        ],
        env={**two_nodes["env"], "PLACEMENT_TESTS_SYSFS": "/nonexistent/driver/sys"},
        timeout=240,
    )
    assert status == 0, err[-4000:]
    rows = out["ranks"]
    gpus_of = {node["node_id"]: node["gpus"] for node in two_nodes["nodes"]}
    assert [r["tp_rank"] for r in rows] == [0, 1, 2, 3]
    assert [r["engine_gpu_id"] for r in rows] == [
        0,
        1,
        0,
        1,
    ]  # RayEngine's per-node GPU index
    for r in rows:
        # The node is one of the cluster's (verify joined it), and the rank's GPU is
        # the one Ray gave it, in that node's own tree; it bound itself there.
        assert int(r["accelerator_ids"][0]) < len(gpus_of[r["node_id"]])
        assert r["ok"] and r["strategy"] == "in-process" and r["numa_node"] == 0, r
        assert r["observed_cpus"] == r["cpus"]
    assert sorted(r["node_id"] for r in rows) == sorted(list(gpus_of) * 2)
    # Rank 0 is on the driver's node's bundle, with TP1; the other node holds TP2 and TP3.
    assert (
        rows[0]["node_id"]
        == rows[1]["node_id"]
        != rows[2]["node_id"]
        == rows[3]["node_id"]
    )


def test_set_cpu_affinity_gives_each_rank_of_a_node_its_own_cpus(two_nodes):
    status, out, err = run_json(
        [*VERIFY, "--device", "cuda", "--tp-size", "2", "--timeout", "150",
         "--set-cpu-affinity"],
        env=two_nodes["env"], timeout=240,
    )  # fmt: skip
    assert status == 0, err[-4000:]
    rows = out["ranks"]
    cpus = [r["cpus"] for r in rows]
    assert len(set(cpus)) == 2 and all(cpus)
    for r in rows:
        assert r["strategy"] == "in-process" and r["ok"], r
        assert (
            r["observed_cpus"] == r["cpus"]
        )  # really bound here: these CPUs exist on this host
        assert any(
            why.startswith("SGLANG_SET_CPU_AFFINITY=1: GPU ") for why in r["reasons"]
        )


def test_a_rank_that_cannot_start_fails_verify_in_one_line_naming_it(two_nodes):
    # --numa-node has an entry for GPU 0 only: the rank Ray gives GPU 1 fails, as sglang's actor would.
    done = subprocess.run(
        [sys.executable, *VERIFY, "--device", "cuda", "--tp-size", "2", "--numa-node", "0",
         "--timeout", "150"],
        capture_output=True, text=True, timeout=240, env=two_nodes["env"],
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [l for l in done.stderr.splitlines() if l.startswith("error: ")]
    assert (
        ": the probe rank failed: SettingError: --numa-node has 1 entry (0) but a rank"
        in line
    )
    assert " uses GPU 1: give one NUMA node per GPU id" in line


def test_verify_with_ray_refuses_a_driver_side_sysfs_root_without_starting_ray(
    tmp_path,
):
    done = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "verify", "--launcher", "ray",
         "--sysfs-root", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "drop --sysfs-root" in done.stderr


def test_verify_without_ray_address_starts_a_local_cluster_and_stops_it():
    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    env = ray_test_env(directory)
    try:
        # RayEngine asks a GPU per actor for a CPU engine too: the cluster verify starts declares them.
        status, out, err = run_json(
            [*VERIFY, "--device", "cpu", "--timeout", "150"], env=env, timeout=240
        )
        assert status == 0, err[-4000:]
        (row,) = out["ranks"]
        assert row["launcher"] == "ray" and row["ok"], row
        # The cluster it started is gone: no process of that session (raylet, GCS, workers) stays running.
        sessions = os.path.join(directory, "ray")
        deadline = time.monotonic() + 15
        while leftover := subprocess.run(
            ["pgrep", "-f", sessions], capture_output=True, text=True
        ).stdout.split():
            assert (
                time.monotonic() < deadline
            ), f"processes of the cluster verify started run on: {leftover}"
            time.sleep(0.2)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_verify_prints_upstream_warnings_and_ray_notices_only_with_v():
    # Both come from verify's own process: the UserWarnings from importing sglang's Ray
    # engine (AWQ, GGUF, Triton on a host without CUDA), the notice from the new local
    # cluster's token authentication (Ray's default while RAY_AUTH_MODE is unset).
    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    env = ray_test_env(directory)
    env.pop("RAY_AUTH_MODE", None)
    argv = [sys.executable, "-m", "sglang.srt.placement_tools", "verify", "--device",
            "cpu", "--launcher", "both", "--timeout", "150"]  # fmt: skip
    try:
        quiet, verbose = (
            subprocess.run(
                argv + flags, capture_output=True, text=True, timeout=240, env=env
            )
            for flags in ([], ["-v"])
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for done in (quiet, verbose):
        assert done.returncode == 0, done.stderr[-4000:]
        rows = done.stdout.splitlines()
        assert [row.split()[3] for row in rows] == ["mp", "ray"], done.stdout
        assert all(row.endswith(": OK") for row in rows), done.stdout
    assert quiet.stderr == "", quiet.stderr[-4000:]
    assert "UserWarning: Only CUDA, HIP and XPU support AWQ" in verbose.stderr
    assert "Token authentication is enabled for this Ray cluster" in verbose.stderr


def test_a_local_cluster_declares_a_gpu_for_every_actor_of_every_node(monkeypatch):
    """RayEngine's placement group asks dp x tp x pp GPUs over all its nodes: the
    cluster verify starts (one node here) must hold them all, or nothing is placed."""
    from sglang.srt.placement_tools import PlanArgs, verify_ray

    started = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(verify_ray.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(verify_ray.ray, "init", lambda **kw: started.update(kw))
    monkeypatch.setattr(verify_ray.ray, "shutdown", lambda: None)
    args = PlanArgs(tp_size=2, dp_size=2, nnodes=2, device="cpu")
    with verify_ray.ray_cluster(args, verbose=False):
        assert started["address"] == "local" and started["num_gpus"] == 4
