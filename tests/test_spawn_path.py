"""sglang's own spawn path: a scheduler started as ``with configure_subprocess(args, gpu_id): proc.start()``.

This is how ``Engine._launch_scheduler_processes`` and the data-parallel
controller start every rank. Each test spawns real children (spawn start
method) and reads their binding back; numactl stand-ins play the numactl of a
host this machine is not (seccomp, no libnuma, a shrinking cpuset), and fake
sysfs trees put GPUs on two nodes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import pytest
from spawn_support import (
    args,
    fake_host,
    numactl_calls,
    numactl_standin,
    start_rank,
    use_fake_host,
    without_numactl,
)

TESTS = Path(__file__).resolve().parent
REAL_CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
    """Four GPUs, two per node; node 0 is this host's CPUs, node 1 CPUs only the tree has."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    use_fake_host(monkeypatch, fake_host(tmp_path / "sys"))
    return tmp_path


@pytest.fixture
def split_host(tmp_path, monkeypatch):
    """Four GPUs, two per node; this host's two CPUs split over the two nodes, so numactl decides."""
    if len(REAL_CPUS) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    root = fake_host(tmp_path / "sys", node_cpus={0: {REAL_CPUS[0]}, 1: {REAL_CPUS[1]}})
    use_fake_host(monkeypatch, root)
    return tmp_path


def use_standin(monkeypatch, tmp_path, mode):
    if mode == "missing":
        without_numactl(monkeypatch)
        return None
    directory, log = numactl_standin(tmp_path / f"numactl-{mode}", mode)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    return log


# --------------------------------------------------------------------------- placed children


def test_a_gpu_rank_starts_under_its_nodes_placement(gpu_host):
    out = start_rank(args(tp_size=2), 1)
    assert out["report"]["policy"] == "bind" and out["report"]["nodes"] == [0], out
    assert out["report"]["cpus"] == REAL_CPUS
    assert not out["warnings"], out["warnings"]


def test_ranks_spawned_from_several_threads_keep_their_own_binding(monkeypatch):
    """The data-parallel controller spawns from one thread per dp rank; each child gets its own CPUs."""
    if len(REAL_CPUS) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{REAL_CPUS[0]}|{REAL_CPUS[1]}")
    results: dict[int, dict] = {}

    def launch(gpu_id: int) -> None:
        results[gpu_id] = start_rank(args(device="cpu", tp_size=1, dp_size=2), gpu_id)

    threads = [threading.Thread(target=launch, args=(g,)) for g in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[g]["report"]["cpus"] for g in (0, 1)] == [
        [REAL_CPUS[0]],
        [REAL_CPUS[1]],
    ]
    assert all(results[g]["report"]["policy"] == "bind" for g in (0, 1))


def test_router_mode_cpu_rank_gets_the_group_of_its_gpu_id(monkeypatch):
    """sglang-router's data parallelism: each worker is a tp=1 engine whose --base-gpu-id is its index."""
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{REAL_CPUS[0]}|{REAL_CPUS[-1]}")
    out = start_rank(args(device="cpu", base_gpu_id=1), 1)
    assert (
        out["report"]["cpus"] == [REAL_CPUS[-1]] and out["report"]["policy"] == "bind"
    ), out


def test_cpu_ranks_are_left_as_upstream_leaves_them_with_bind_v2_off(monkeypatch):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{REAL_CPUS[0]}|{REAL_CPUS[-1]}")
    monkeypatch.setenv("SGLANG_NUMA_BIND_V2", "0")
    out = start_rank(args(device="cpu", tp_size=2), 1)
    assert (
        out["report"]["cpus"] == REAL_CPUS and out["report"]["policy"] == "default"
    ), out


# --------------------------------------------------------------------------- the GPU it is given


@pytest.mark.parametrize("dp_size", [1, 2])
def test_one_visible_device_per_process_binds_each_gpus_node_and_never_raises(
    split_host, monkeypatch, tmp_path, dp_size
):
    """SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: upstream's maybe_reindex_device_id narrows
    CUDA_VISIBLE_DEVICES to one GPU and hands configure_subprocess gpu_id 0, for tp=2 x dp=2.
    """
    from sglang.srt.placement_tools.engine import local_ranks
    from sglang.srt.platforms.cuda import CudaDeviceMixin
    from sglang.srt.utils import common
    from sglang.srt.utils.common import maybe_reindex_device_id

    # This host's platform is the CPU; upstream's CUDA narrowing is what runs on a GPU host.
    monkeypatch.setattr(
        common,
        "current_platform",
        types.SimpleNamespace(
            reindex_device_id=functools.partial(CudaDeviceMixin.reindex_device_id, None)
        ),
    )
    log = use_standin(monkeypatch, tmp_path, "record")
    monkeypatch.setenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    engine = args(tp_size=4 // dp_size, dp_size=dp_size)
    spawned = []
    for rank in local_ranks(engine):
        with maybe_reindex_device_id(rank.device.index) as gpu_id:
            assert gpu_id == 0 and os.environ["CUDA_VISIBLE_DEVICES"] == str(
                rank.device.index
            )
            spawned.append((rank.device.index, start_rank(engine, gpu_id)))
    for physical, out in spawned:
        assert "error" not in out and out["report"] is not None, out
        assert not out["warnings"], out["warnings"]
    # Each spawn ran under the node of the physical GPU it was given (GPUs 0, 1 on node 0; 2, 3 on node 1;
    # this kernel has no node 1 memory to bind, which the VM test covers).
    spawns = [
        [a for a in c if a.startswith("--cpunodebind") or a.startswith("--membind")]
        for c in numactl_calls(log)
        if "-c" in c
    ]
    assert (
        spawns == [["--cpunodebind=0", "--membind=0"]] * 2 + [["--cpunodebind=1"]] * 2
    )


def test_a_gpu_id_is_identified_alone(gpu_host, monkeypatch):
    """Only the device of the given id is asked about: a CUDA_VISIBLE_DEVICES too short for the other
    ranks of the engine is fine, as long as it names this one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = start_rank(args(tp_size=4), 0)
    assert out["report"]["policy"] == "bind" and not out["warnings"], out


def test_a_gpu_that_cannot_be_found_runs_unbound_with_the_reason(gpu_host, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = start_rank(args(tp_size=2), 1)
    assert out["report"]["policy"] == "default" and "error" not in out
    assert any(
        "GPU 1: no NUMA node" in w and "CUDA_VISIBLE_DEVICES" in w
        for w in out["warnings"]
    ), out


# --------------------------------------------------------------------------- less bound than intended


FAILURES = {
    # numactl refusing every option set, as under a seccomp profile that denies the NUMA syscalls.
    "refuse-all": (
        "numactl could not apply NUMA binding for node 1",
        "Operation not permitted",
    ),
    # libnuma missing: numactl itself cannot start.
    "no-libnuma": ("numactl could not apply NUMA binding for node 1", "libnuma.so.1"),
    # numactl not installed at all.
    "missing": ("numactl is not installed", "apt-get install numactl"),
}


@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_a_rank_that_cannot_be_bound_warns_naming_its_gpu(
    split_host, monkeypatch, tmp_path, mode
):
    use_standin(monkeypatch, tmp_path, mode)
    out = start_rank(args(tp_size=4), 2)
    assert out["report"]["policy"] == "default", out
    [line] = [w for w in out["warnings"] if w.startswith("WARNING")]
    for needle in (*FAILURES[mode], "skipping NUMA binding for GPU 2"):
        assert needle in line, line


@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_under_the_crash_setting_nothing_is_started(
    split_host, monkeypatch, tmp_path, mode
):
    use_standin(monkeypatch, tmp_path, mode)
    monkeypatch.setenv("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", "1")
    out = start_rank(args(tp_size=4), 2)
    assert out["started"] is False, out
    assert (
        out["error"].startswith("PlacementError") and FAILURES[mode][1] in out["error"]
    ), out


def test_a_weaker_memory_policy_warns_in_upstreams_words(
    gpu_host, monkeypatch, tmp_path
):
    use_standin(monkeypatch, tmp_path, "refuse-membind")
    out = start_rank(args(tp_size=4), 1)
    # One WARNING, in upstream's words (the INFO line of the spawn names the rank).
    [line] = [w for w in out["warnings"] if w.startswith("WARNING")]
    assert (
        "numactl rejected hard memory binding ('--cpunodebind=0 --membind=0'): numactl: setting membind: "
        "Invalid argument; falling back to soft preferred policy ('--cpunodebind=0 --preferred=0')"
        in line
    )


CONFINED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from spawn_support import args, start_rank
print(json.dumps({gpu: start_rank(args(tp_size=4), gpu) for gpu in (0, 2)}))
"""


@pytest.mark.parametrize("crash", ["0", "1"])
def test_a_parent_confined_to_node_0_warns_for_node_1_gpus(tmp_path, crash):
    """``taskset -c 0`` around the engine: GPU 2's node 1 (CPU 1) is excluded by the parent's affinity."""
    if len(REAL_CPUS) < 2:
        pytest.skip("needs two CPUs")
    root = fake_host(tmp_path / "sys", node_cpus={0: {REAL_CPUS[0]}, 1: {REAL_CPUS[1]}})
    env = {
        **os.environ,
        "PLACEMENT_TESTS_SYSFS": str(root),
        "PLACEMENT_TESTS_PLATFORM": "cuda",
        "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": crash,
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [
            "taskset",
            "-c",
            str(REAL_CPUS[0]),
            sys.executable,
            "-c",
            CONFINED,
            str(TESTS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    node_1 = out["2"]
    expected = (
        f"NUMA node 1 has no CPU cores allowed by the current affinity [{REAL_CPUS[0]}]"
    )
    if crash == "1":
        assert node_1["started"] is False and expected in node_1["error"], node_1
    else:
        assert (
            node_1["report"]["cpus"] == [REAL_CPUS[0]]
            and node_1["report"]["policy"] == "default"
        )
        assert any(
            expected in w and "skipping NUMA binding for GPU 2" in w
            for w in node_1["warnings"]
        ), node_1
    assert out["0"]["report"]["policy"] == "bind" and not out["0"]["warnings"], out["0"]


def test_a_numactl_that_fails_at_the_childs_exec_is_the_childs_exit_with_its_reason(
    gpu_host, monkeypatch, tmp_path
):
    """The probe passed, then the cpuset shrank: numactl kills the child before Python starts.
    Its launcher sees the exit, as any failed start (upstream's probe makes it rare); numactl
    says why on the child's stderr."""
    use_standin(monkeypatch, tmp_path, "shrinks-after-probe")
    saved = os.dup(2)
    with open(tmp_path / "stderr", "w+b") as stderr:
        os.dup2(stderr.fileno(), 2)
        try:
            out = start_rank(args(tp_size=4), 1, timeout_s=10)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        stderr.seek(0)
        assert b"sched_setaffinity: Invalid argument" in stderr.read()
    assert out["report"] is None and out["exitcode"] == 1, out
    assert not [w for w in out["warnings"] if w.startswith("ERROR")], out


# --------------------------------------------------------------------------- settings


def test_a_gpu_engine_ignores_the_cpu_threads_setting(gpu_host, monkeypatch):
    from sglang.srt.utils import numa_utils

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "")
    out = start_rank(args(tp_size=2), 0)
    assert out["report"]["policy"] == "bind" and not out["warnings"], out
    assert numa_utils.get_numa_node_if_available(args(numa_node=[1, 0]), 1) == 0


def test_overlapping_groups_follow_one_rule_in_plan_and_bootstrap(monkeypatch, caplog):
    from sglang.srt.utils import numa_utils

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{REAL_CPUS[0]}|{REAL_CPUS[0]}")
    with caplog.at_level("WARNING", logger="sglang.srt.utils.numa_utils"):
        assert numa_utils.init_threads_binding(numa_index=1, world_size=2) == str(
            REAL_CPUS[0]
        )
    assert any("group 1 shares CPU(s)" in r.getMessage() for r in caplog.records)
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.srt.placement_tools",
            "plan",
            "--device",
            "cpu",
            "--tp-size",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    rank_1 = json.loads(plan.stdout)["ranks"][1]
    assert rank_1["cpus"] == str(REAL_CPUS[0]) and any(
        "group 1 shares CPU(s)" in r for r in rank_1["reasons"]
    )


# --------------------------------------------------------------------------- no files, noexec /tmp

# Runs as root in a private mount namespace: /tmp becomes a fresh noexec tmpfs for the launch only, so
# that its listing shows exactly what the launch left there. Folders of /tmp that this test runs from (a
# checkout or a virtual environment under /tmp) are bound back in at the same path.
MOUNT_HELPER = r"""
import json, os, subprocess, sys
tops = json.loads(sys.argv[1])
held = {top: os.open(top, os.O_RDONLY | os.O_DIRECTORY) for top in tops}
subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,nosuid,nodev,mode=1777", "sglang-test-tmp", "/tmp"], check=True)
for top, fd in held.items():
    os.mkdir(top, 0o755)
    subprocess.run(["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", top], check=True, pass_fds=(fd,))
    os.close(fd)
os.execv(sys.argv[2], sys.argv[2:])
"""

NOEXEC_SCRIPT = r"""
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from spawn_support import args, start_rank
with open("/proc/self/mountinfo") as f:
    tmp_options = [line.split()[5] for line in f if line.split()[4] == "/tmp"]
before = sorted(os.listdir("/tmp"))
os.environ["TMPDIR"] = "/tmp"
noexec = start_rank(args(device="cpu", tp_size=2), 0)
os.environ["TMPDIR"], tempfile.tempdir = sys.argv[2], None  # Python caches it
placed = start_rank(args(device="cpu", tp_size=2), 1)
print(json.dumps({"tmp_options": tmp_options, "noexec": noexec, "placed": placed,
                  "before": before, "after": sorted(os.listdir("/tmp")),
                  "other": sorted(os.listdir(sys.argv[2]))}))
"""


def _tops_under_tmp(paths):
    tops = set()
    for path in paths:
        real = os.path.realpath(path)
        if real.startswith("/tmp/"):
            tops.add("/tmp/" + real.split("/")[2])
    return sorted(tops)


def test_a_noexec_tmpdir_is_named_and_the_wrapper_never_outlives_the_spawn(
    monkeypatch,
):
    """The numactl wrapper lives in a private directory of TMPDIR only until the child
    has started: a noexec TMPDIR is a WARNING naming it (the rank runs unbound), and
    neither TMPDIR keeps anything."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1): mounts a private noexec /tmp")
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{REAL_CPUS[0]}|{REAL_CPUS[-1]}")
    tops = _tops_under_tmp([TESTS.parent, sys.prefix, sys.executable, TESTS])
    other = tempfile.mkdtemp(dir="/var/tmp")  # outside the private /tmp
    atexit_cleanup = functools.partial(shutil.rmtree, other, ignore_errors=True)
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            MOUNT_HELPER,
            json.dumps(tops),
            sys.executable,
            "-c",
            NOEXEC_SCRIPT,
            str(TESTS),
            other,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(TESTS.parent),
    )
    atexit_cleanup()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("noexec" in opt for opt in out["tmp_options"])
    noexec, placed = out["noexec"], out["placed"]
    assert noexec["report"]["cpus"] == REAL_CPUS, noexec
    assert any("TMPDIR (/tmp) is on a noexec mount" in w for w in noexec["warnings"])
    assert placed["report"]["cpus"] == [REAL_CPUS[-1]] and not placed["warnings"]
    assert out["after"] == out["before"] and out["other"] == []


def test_set_cpu_affinity_starts_a_gpu_on_its_slice_of_the_node(tmp_path, monkeypatch):
    """Two nodes of 4 cores x 2 threads and two GPUs each: GPU 1's spawn runs under the
    second half of node 0's cores, SMT siblings together."""
    import fakesys

    from sglang.srt.utils import numa_utils

    shape = fakesys.Shape(
        sockets=2, cores_per_node=4, threads_per_core=2, gpus_per_node=2
    )
    use_fake_host(monkeypatch, fakesys.write_sysfs(tmp_path / "sys", shape))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SGLANG_SET_CPU_AFFINITY", "1")
    # This host has 2 CPUs and one node; the process may use every CPU of the tree.
    monkeypatch.setattr(numa_utils.os, "sched_getaffinity", lambda pid: set(range(16)))
    log = use_standin(monkeypatch, tmp_path, "record")
    out = start_rank(args(tp_size=4), 1)
    assert out["report"] is not None and not out["warnings"], out
    (spawn,) = [c for c in numactl_calls(log) if "-c" in c]
    assert spawn[: spawn.index(sys.executable)] == [
        "--physcpubind=2,3,10,11",
        "--membind=0",
    ]
