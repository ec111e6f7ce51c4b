"""The Ray launcher's GPU path on this CPU host: a one-node cluster declaring 4 GPUs, a fake /sys holding them.

The raylet is started with SGLANG_SYSFS_ROOT pointing at a tree that has this
host's allowed CPUs (padded to 8 with CPUs it lacks) and the 4 GPUs on NUMA
node 0, plus a GPU-less node 1, so node binding applies and its numactl
options (--physcpubind=<this host's CPUs> --membind=0) really run here. Each
scenario is a separate driver joining that cluster through RAY_ADDRESS (this
test process's own Ray connection is the session's CPU-only cluster): the
``verify`` command with --json, or ``ray_gpu_driver.py`` for what verify
cannot express (bundles of two GPUs, a planner that allows the tree's CPUs).
"""

from __future__ import annotations

import pytest

import fakesys
from ray_gpu_cluster import run_json, running_cluster

pytestmark = pytest.mark.ray

GPUS = [fakesys.gpu_address(i) for i in range(4)]


@pytest.fixture(scope="module")
def one_node():
    with running_cluster("0,1,2,3") as cluster:
        yield cluster


def verify(cluster, *args: str) -> tuple[int, list[dict], str]:
    status, out, err = run_json(["-m", "sglang.srt.placement", "verify", "--launcher", "ray", "--device", "cuda",
                                 "--json", "--timeout", "90", *args], env=cluster["env"])
    return status, out["ranks"], err


def node_of(row: dict) -> str:
    (where,) = [r for r in row["reasons"] if r.startswith("resolved on Ray node ")]
    return where.removeprefix("resolved on Ray node ")


@pytest.fixture(scope="module")
def driver(one_node):
    """Every driver scenario, run once in one driver process (a Ray driver costs seconds to start)."""
    status, out, err = run_json(["tests/ray_gpu_driver.py", "one_gpu_bundles", "two_gpu_bundle_node",
                                 "two_gpu_bundle_exclusive", "exclusive_on_cpus_this_host_lacks"],
                                env=one_node["env"])
    assert status == 0, err[-4000:]
    assert out["leftover_actors"] == [] and out["leftover_groups"] == []
    return out


def test_verify_tp4_on_one_node_gives_each_rank_the_gpu_ray_gave_it(one_node):
    status, rows, err = verify(one_node, "--tp-size", "4")
    assert status == 0, err[-4000:]
    assert [(r["tp_rank"], r["pci"]) for r in rows] == list(enumerate(GPUS))
    (node,) = one_node["nodes"]
    for r in rows:
        assert r["strategy"] == "exec" and r["numa_node"] == 0 and r["mem_policy"] == "bind", r["reasons"]
        assert r["ok"], r["differences"]
        # verify joined the cluster RAY_ADDRESS names (its node planned the ranks) rather than starting its own.
        assert node_of(r) == node["node_id"]
        assert r["observed_cpus"] == r["cpus"]


def test_verify_dp2_tp2_on_one_node(one_node):
    status, rows, err = verify(one_node, "--dp-size", "2", "--tp-size", "2")
    assert status == 0, err[-4000:]
    assert [(r["dp_rank"], r["tp_rank"], r["gpu_id"]) for r in rows] == [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                                         (1, 1, 3)]
    assert sorted(r["pci"] for r in rows) == GPUS
    assert all(r["ok"] and r["strategy"] == "exec" for r in rows)


def test_verify_exclusive_mode_gives_each_rank_its_own_cpus_of_this_host(one_node):
    status, rows, err = verify(one_node, "--tp-size", "2", "--numa-affinity-mode", "exclusive")
    assert status == 0, err[-4000:]
    cpus = [r["cpus"] for r in rows]
    assert len(set(cpus)) == 2 and all(cpus)
    for r in rows:
        assert r["strategy"] == "exec" and r["ok"], r
        assert r["numactl_args"][0] == f"--physcpubind={r['cpus']}"
        assert r["observed_cpus"] == r["cpus"]  # really bound here: these CPUs exist on this host


def test_an_actor_in_a_one_gpu_bundle_gets_the_id_the_bundles_probe_saw(driver):
    assert driver["one_gpu_bundles"]["probe_ids"] == [["0"], ["1"], ["2"], ["3"]]
    assert driver["one_gpu_bundles"]["actor_ids"] == driver["one_gpu_bundles"]["probe_ids"]


def test_a_two_gpu_bundle_reports_both_ids_and_candidates_that_agree_start_under_numactl(driver):
    scenario = driver["two_gpu_bundle_node"]
    for rank_candidates in scenario["candidates"]:
        assert [(gpu, pci, strategy) for gpu, pci, strategy, _ in rank_candidates] == [
            ("0", GPUS[0], "exec"), ("1", GPUS[1], "exec")]
    assert all(e and "--membind=0" in e for e in scenario["py_executables"])
    ranks = scenario["ranks"]
    assert sorted(r["actor_gpu"][0] for r in ranks) == ["0", "1"]
    for r in ranks:
        # Each actor reports the placement of the GPU it got, not the first candidate's.
        assert r["pci"] == GPUS[int(r["actor_gpu"][0])]
        assert r["strategy"] == "exec" and r["mismatches"] == []


def test_a_two_gpu_bundle_in_exclusive_mode_binds_each_actor_in_process_to_its_gpus_slice(driver):
    scenario = driver["two_gpu_bundle_exclusive"]
    (first, second) = scenario["candidates"]
    assert first == second  # both ranks may get either GPU
    assert [cpus for *_, cpus in first][0] != [cpus for *_, cpus in first][1]
    assert scenario["py_executables"] == [None, None]
    slice_of = {gpu: cpus for gpu, _, _, cpus in first}
    for r in scenario["ranks"]:
        gpu = r["actor_gpu"][0]
        assert r["strategy"] == "in-process" and r["pci"] == GPUS[int(gpu)]
        assert r["cpus"] == ",".join(map(str, slice_of[gpu])) and r["observed_cpus"] == r["cpus"]
        assert r["mismatches"] == []
        assert "bind differently; the actor binds in-process once it knows its id" in r["reasons"][-1]


def test_exclusive_tp4_slices_the_trees_cpus_even_where_this_host_lacks_them(driver):
    # The planner allows the tree's 8 CPUs (this host has 2): the plan is the tree's; ranks whose slice names
    # CPUs this host lacks cannot bind (numactl refuses, then in-process is refused), which is reported, not fatal.
    ranks = driver["exclusive_on_cpus_this_host_lacks"]["ranks"]
    assert [r["cpus"] for r in ranks] == ["0-1", "2-3", "4-5", "6-7"]
    assert [r["pci"] for r in ranks] == GPUS and [r["actor_gpu"] for r in ranks] == [["0"], ["1"], ["2"], ["3"]]
    assert ranks[0]["strategy"] == "exec" and ranks[0]["mismatches"] == []
    for r in ranks[1:]:
        assert r["strategy"] == "in-process"
        assert any("rejected by the kernel" in why for why in r["reasons"])
        assert f"cpus 0-1 observed, {r['cpus']} planned" in r["mismatches"]
