"""``verify`` on this host: probe ranks started through sglang's own launch paths (a
spawn inside ``configure_subprocess`` running ``run_scheduler_process``; a Ray
``SchedulerActor`` made by ``_create_scheduler_actor``) read their binding back.

Ray: ``test_demo_cpu_engine`` lets verify start its own local cluster (the demo's
way); the GPU test needs its cluster inside a fake host's mount namespace, started by
``tools_ray.py`` there, so that any tree's tools (``PLACEMENT_TOOLS_TREE``) join one
with the GPUs declared.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import tempfile
from pathlib import Path

import fakehost
import fakesys
import pytest
import tools_hosts

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "python/sglang/srt/placement_tools/standin"
CPUS = sorted(os.sched_getaffinity(0))
HALF = max(len(CPUS) // 2, 1)
HALVES = [fakesys.format_cpulist(CPUS[:HALF]), fakesys.format_cpulist(CPUS[HALF:])]
"""The demo's groups: each of two ranks half of this process's CPUs."""

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to split")


@pytest.mark.ray
def test_demo_cpu_engine_every_rank_ok():
    """The demo's two-rank CPU engine, spawned and as Ray actors: each rank on its
    half, every thread of it; a spawned rank's memory bound to node 0 from its start,
    a Ray actor's preferred there (it binds itself once running)."""
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(HALVES), "RAY_ADDRESS": None}
    argv = ["verify", "--device", "cpu", "--tp-size", "2", "--launcher", "both"]
    rows = tools_hosts.ranks(tools_hosts.run_tools([*argv, "--json"], env=env))
    assert [(r["launcher"], r["tp_rank"]) for r in rows] == [
        ("mp", 0),
        ("mp", 1),
        ("ray", 0),
        ("ray", 1),
    ]
    for row in rows:
        assert row["ok"] and row["differences"] == [], row
        half = HALVES[row["gpu_id"]]
        assert row["cpus"] == row["observed_cpus"] == half
        assert set(row["thread_cpus"].values()) == {half}
        assert row["local_page_share"] == 1.0 and row["observed_mems"] == "0"
    assert [r["observed_policy"] for r in rows] == ["bind:0"] * 2 + ["preferred:0"] * 2
    assert [r["strategy"] for r in rows] == ["exec"] * 2 + ["in-process"] * 2
    assert sorted(r["gpu_id"] for r in rows[2:]) == [0, 1]


def test_a_rank_bound_otherwise_than_planned_is_a_mismatch():
    """TMPDIR on a noexec mount: the plan says exec under numactl (memory bound), but
    the wrapper cannot run there, so the rank binds itself (memory preferred). verify
    reads that back and exits 1."""
    fakehost.require_root()
    script = (
        'mount -t tmpfs -o noexec,mode=0700 tmpfs "$1" || exit 97; shift; exec "$@"'
    )
    with tempfile.TemporaryDirectory(prefix="tools-noexec-") as tmp:
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        argv += ["sh", tmp, tools_hosts.PYTHON, *tools_hosts.TOOLS, "verify"]
        argv += ["--device", "cpu", "--tp-size", "1"]
        env = {**os.environ, "TMPDIR": tmp, "SGLANG_CPU_OMP_THREADS_BIND": HALVES[0]}
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == (
        f"[DP0 PP0 TP0] mp gpu_id 0 node 0 via exec: cpus {HALVES[0]} (plan "
        f"{HALVES[0]}), mems 0, policy preferred:0 (plan bind:0), local pages 100.0%: "
        "MISMATCH: policy preferred:0 observed, bind:0 planned\n"
    )
    assert "is on a noexec mount" in done.stderr


def fake_gpu_host() -> fakesys.Host:
    """Node 0: this host's CPUs (and one it lacks) and GPUs 0 and 1; node 1: CPUs it
    lacks. Each GPU's rank binds to the real CPUs, memory on node 0."""
    lacking = itertools.count(max(CPUS) + 1)
    return fakesys.Host(
        nodes={
            0: fakesys.NodeSpec(cpus=[*CPUS, next(lacking)]),
            1: fakesys.NodeSpec(cpus=[next(lacking), next(lacking)]),
        },
        pci=[
            fakesys.host_bridge(0),
            fakesys.PciSpec(fakesys.gpu_address(0), 0),
            fakesys.PciSpec(fakesys.gpu_address(1), 0),
        ],
    )


@pytest.mark.ray
def test_ray_rows_carry_each_ranks_pci_address():
    """Each Ray row names the PCI address of the GPU Ray gave its actor, as planned
    and as the rank reads it back (its CUDA device, through NVML). The previous cut
    of the tools printed ``"pci": null`` for every Ray row."""
    gpus = [fakesys.gpu_address(0), fakesys.gpu_address(1)]
    env = {**fakehost.gpu_env(gpus), "PLACEMENT_TOOLS_GPUS": ",".join(gpus)}
    python = tools_hosts.PYTHON
    path = os.pathsep.join([str(STANDIN), tools_hosts.HARNESS])
    verify = [python, *tools_hosts.TOOLS, "verify", "--tp-size", "2"]
    argv = ["env", f"PYTHONPATH={path}", python, str(HERE / "tools_ray.py"), "2"]
    argv += ["--", *verify, "--launcher", "ray", "--json"]
    done = fakehost.run(fake_gpu_host(), argv, env=env, timeout=400)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    rows = json.loads(done.stdout)["ranks"]
    assert sorted(row["gpu_id"] for row in rows) == [0, 1]
    for row in rows:
        assert row["pci"] == fakesys.gpu_address(row["gpu_id"]), row
        assert row["observed_pci"] == row["pci"] and row["ok"], row
