"""`python -m sglang.srt.placement_tools plan` and `capture`, as a user runs them, on sysfs trees laid out like /sys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import fakesys
import pytest

from sglang.srt.placement_tools.__main__ import main

PLAN = [sys.executable, "-m", "sglang.srt.placement_tools", "plan"]


def run_plan(*args, env=None):
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SGLANG_") and k != "CUDA_VISIBLE_DEVICES"
    }
    full_env.update(env or {})
    return subprocess.run(
        [*PLAN, *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


def plan_json(capsys, *args, env=None, monkeypatch=None):
    code = main(["plan", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["ranks"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SGLANG_") or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)


def test_plan_json_two_sockets_four_gpus(tmp_path, capsys):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    ranks = plan_json(capsys, "--tp-size", 4, "--sysfs-root", root)
    assert [r["numa_node"] for r in ranks] == [0, 0, 1, 1]
    assert [r["pci"] for r in ranks] == [
        "0000:18:00.0",
        "0000:28:00.0",
        "0000:38:00.0",
        "0000:48:00.0",
    ]
    assert ranks[0]["cpus"] == "0-7,16-23" and ranks[3]["cpus"] == "8-15,24-31"
    assert all(r["strategy"] == "exec" and r["mem_policy"] == "bind" for r in ranks)
    assert set(ranks[0]) >= {
        "dp_rank",
        "pp_rank",
        "tp_rank",
        "gpu_id",
        "pci",
        "numa_node",
        "cpus",
        "mem_policy",
        "strategy",
        "reasons",
    }
    assert any(
        "planned from the snapshot" in r and "not probed" in r
        for r in ranks[0]["reasons"]
    )


def test_plan_json_set_cpu_affinity_slices_each_node_between_its_gpus(tmp_path, capsys):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    ranks = plan_json(
        capsys, "--tp-size", 4, "--sysfs-root", root, "--set-cpu-affinity"
    )
    assert [r["cpus"] for r in ranks] == [
        "0-3,16-19",
        "4-7,20-23",
        "8-11,24-27",
        "12-15,28-31",
    ]
    assert "2 of the 2 GPUs on node 0" in "; ".join(ranks[1]["reasons"])


def test_plan_json_sparse_and_cpuless_and_unknown(tmp_path, capsys):
    sparse = plan_json(
        capsys, "--tp-size", 2, "--sysfs-root", fakesys.sparse_nodes(tmp_path / "a")
    )
    # As upstream's _is_numa_available: without a node 1, no GPU node is looked for.
    assert [r["strategy"] for r in sparse] == ["none", "none"]
    assert "one NUMA node" in sparse[0]["reasons"][0]
    unknown = plan_json(
        capsys, "--tp-size", 1, "--sysfs-root", fakesys.gpu_unknown_node(tmp_path / "b")
    )
    assert unknown[0]["numa_node"] is None and unknown[0]["strategy"] == "none"
    assert any("numa_node -1" in r for r in unknown[0]["reasons"])


def test_plan_with_allowed_cpus_and_reordered_devices(tmp_path, capsys, monkeypatch):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,0,1")
    ranks = plan_json(
        capsys, "--tp-size", 4, "--sysfs-root", root, "--allowed-cpus", "0-3,8-9"
    )
    assert [r["numa_node"] for r in ranks] == [1, 1, 0, 0]
    assert ranks[0]["cpus"] == "8-9" and ranks[2]["cpus"] == "0-3"


def test_plan_with_explicit_gpus(tmp_path, capsys):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    ranks = plan_json(
        capsys, "--tp-size", 2, "--sysfs-root", root, "--gpus", "38:00.0,0000:18:00.0"
    )
    assert [(r["pci"], r["numa_node"]) for r in ranks] == [
        ("0000:38:00.0", 1),
        ("0000:18:00.0", 0),
    ]


def test_plan_human_output_one_line_per_rank(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    done = run_plan("--tp-size", 2, "--dp-size", 2, "--sysfs-root", root)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        "[DP0 PP0 TP0] GPU 0 (0000:18:00.0): node 0 CPUs 0-7,16-23 membind 0 via exec"
    )
    assert lines[3].startswith("[DP1 PP0 TP1] GPU 3 (0000:48:00.0): node 1")


def test_plan_still_warns_of_a_setting_it_cannot_read_and_leaves_filters_alone(
    tmp_path,
):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    done = run_plan("--sysfs-root", root, env={"SGLANG_AUTO_NUMA_BIND": "maybe"})
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1, done
    assert "Invalid value for SGLANG_AUTO_NUMA_BIND" in done.stderr
    # Called in-process, main hands back the warning filters it found.
    filters = list(warnings.filters)
    assert main(["plan", "--sysfs-root", str(root)]) == 0
    assert warnings.filters == filters


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--tp-size", "0"], {}, "--tp-size=0 is not valid"),
        (
            ["--tp-size", "x"],
            {},
            "argument --tensor-parallel-size/--tp-size/--tp: invalid int value: 'x'",
        ),
        (
            ["--allowed-cpus", "0-3,a"],
            {},
            "--allowed-cpus: 'a' in '0-3,a' is not a CPU number or range",
        ),
        (
            ["--allowed-cpus", "64-65"],
            {},
            "--allowed-cpus='64-65' names CPU(s) 64-65 that are not online",
        ),
        (["--gpus", "0000:18:00.0,"], {}, "--gpus='0000:18:00.0,' is not valid"),
        (["--gpus", "zz:00.0"], {}, "--gpus"),
        (
            ["--gpus", "0000:18:00.0"],
            {},
            "--gpus lists 1 address(es) but a rank uses GPU id 1",
        ),
        (
            ["--numa-node", "0"],
            {},
            "--numa-node has 1 entry (0) but a rank uses GPU 1",
        ),
        (
            ["--device", "cpu"],
            {"SGLANG_CPU_OMP_THREADS_BIND": "0-3"},
            "SGLANG_CPU_OMP_THREADS_BIND='0-3' has 1 group(s)",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, env, message):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    done = run_plan("--tp-size", 2, "--sysfs-root", root, *args, env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert message in lines[0]


def test_truncated_snapshot_is_a_clear_error(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    (root / "devices/system/cpu/online").unlink()
    done = run_plan("--sysfs-root", root)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "devices/system/cpu/online" in done.stderr and "capture" in done.stderr


def test_corrupt_snapshot_is_a_clear_error(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    (root / "devices/system/node/node1/cpulist").write_text("8-x\n")
    done = run_plan("--sysfs-root", root)
    assert (
        done.returncode == 2
        and "node1/cpulist" in done.stderr
        and "Traceback" not in done.stderr
    )


def test_capture_then_plan_from_the_snapshot_round_trip(tmp_path):
    snapshot = tmp_path / "snap"
    done = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "capture", str(snapshot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "plan --sysfs-root" in done.stdout
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0"}
    live = run_plan("--device", "cpu", "--json", "--allowed-cpus", "0", env=env)
    planned = run_plan(
        "--device",
        "cpu",
        "--json",
        "--allowed-cpus",
        "0",
        "--sysfs-root",
        snapshot,
        env=env,
    )
    assert live.returncode == 0 and planned.returncode == 0, (
        live.stderr + planned.stderr
    )
    (live_rank,) = json.loads(live.stdout)["ranks"]
    (snap_rank,) = json.loads(planned.stdout)["ranks"]
    for key in ("numa_node", "cpus", "mem_policy", "strategy"):
        assert live_rank[key] == snap_rank[key], key
    again = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "capture", str(snapshot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and str(snapshot) in again.stderr


def test_live_plan_on_this_host_binds_nothing_for_gpus_and_says_why():
    done = run_plan("--tp-size", 1)
    assert done.returncode == 0, done.stderr
    assert "not bound" in done.stdout


H200_SNAPSHOT = os.path.join(os.path.dirname(__file__), "data", "h200_snapshot")


def test_real_h200_host_snapshot_binds_nothing_and_says_why(capsys):
    """Captured on a rented one-GPU H200 VM: one node, 16 CPUs, the GPU's numa_node is -1."""
    (rank,) = plan_json(capsys, "--tp-size", 1, "--sysfs-root", H200_SNAPSHOT)
    # One node: sglang's own precondition says there is nothing to bind, before any device is asked about.
    assert rank["strategy"] == "none" and rank["numa_node"] is None and not rank["cpus"]
    assert any("this host has one NUMA node" in r for r in rank["reasons"])
    # SGLANG_SET_CPU_AFFINITY=1 without a node: upstream's own slice (all of it, tp 1).
    (rank,) = plan_json(
        capsys, "--tp-size", 1, "--sysfs-root", H200_SNAPSHOT, "--set-cpu-affinity"
    )
    assert (rank["strategy"], rank["cpus"]) == ("cpu-affinity", "0-15")


def test_verify_refuses_a_snapshot_since_it_runs_ranks_on_this_host(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.srt.placement_tools",
            "verify",
            "--tp-size",
            "2",
            "--sysfs-root",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "--sysfs-root is a planning input that sglang's launch path does not take"
        in done.stderr
    )


def test_the_affinity_flag_overrides_the_setting_it_stands_for(
    tmp_path, capsys, monkeypatch
):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.setenv("SGLANG_SET_CPU_AFFINITY", "0")
    args = ("--tp-size", 4, "--sysfs-root", root, "--set-cpu-affinity")
    ranks = plan_json(capsys, *args)
    assert [r["cpus"] for r in ranks][:2] == ["0-3,16-19", "4-7,20-23"]
    assert os.environ["SGLANG_SET_CPU_AFFINITY"] == "0"  # restored after


def test_one_visible_device_per_process_past_the_visible_list_is_named_not_bound(
    tmp_path, capsys, monkeypatch
):
    """Upstream's maybe_reindex_device_id fails for GPU ids past CUDA_VISIBLE_DEVICES:
    the plan names the setting for those ranks and binds the others."""
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.setenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    ranks = plan_json(capsys, "--tp-size", 4, "--sysfs-root", root)
    assert [r["numa_node"] for r in ranks] == [1, 1, None, None]
    assert [r["pci"] for r in ranks][:2] == ["0000:48:00.0", "0000:38:00.0"]
    for rank in ranks[2:]:
        assert rank["strategy"] == "none"
        assert any(
            "CUDA_VISIBLE_DEVICES='3,2' makes 2 GPU(s) visible, but a rank uses GPU id"
            in why
            for why in rank["reasons"]
        ), rank["reasons"]
        assert not any("spawned as GPU 0" in why for why in rank["reasons"])
