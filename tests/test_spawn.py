"""sglang's spawn path on this host: real numactl and libnuma, real spawned ranks.

Each rank is started as sglang's Engine starts a scheduler: a spawn-context Process
whose ``start()`` runs inside ``numa_utils.configure_subprocess(server_args, gpu_id)``
(tests/harness/rank_probe.py), and reports the binding the kernel gave it from
/proc/self/status and get_mempolicy(2). The ranks are CPU-device ranks, each given its
CPU by ``SGLANG_CPU_OMP_THREADS_BIND``; this host has one NUMA node, node 0.

Most launches run in this process; a launch that must change the process for good (a
seccomp filter, a private mount) runs in a launching process of its own
(tests/harness/launch_ranks.py).
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import fakehost
import pytest
import rank_probe

REAL = sorted(os.sched_getaffinity(0))
NODES = glob.glob("/sys/devices/system/node/node[0-9]*")
LAUNCHER = Path(__file__).resolve().parent / "harness" / "launch_ranks.py"
OMP = "SGLANG_CPU_OMP_THREADS_BIND"
pytestmark = [
    pytest.mark.skipif(
        len(REAL) < 2, reason="gives two ranks one CPU each: needs two CPUs"
    ),
    pytest.mark.skipif(
        len(NODES) != 1, reason="written for a host with one NUMA node, as CI's"
    ),
]


def cpu_engine(**fields) -> dict:
    return {"device": "cpu", **fields}


@pytest.fixture
def spawning(monkeypatch):
    """This process as sglang's Engine leaves it: the spawn start method (restored
    after), and a private TMPDIR, whose path needs quoting, for the wrappers."""
    saved = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    parent = tempfile.gettempdir()
    private = tempfile.mkdtemp(prefix="test-spawn-", dir=parent)
    tmpdir = os.path.join(private, "tmp dir $(false) 'q'")
    os.mkdir(tmpdir, 0o700)
    monkeypatch.setenv("TMPDIR", tmpdir)
    monkeypatch.setattr(tempfile, "tempdir", tmpdir)
    try:
        yield Path(tmpdir)
    finally:
        multiprocessing.set_start_method(saved, force=True)
        remove_private(private, parent=parent, prefix="test-spawn-")


def remove_private(path: str, *, parent: str, prefix: str) -> None:
    """Remove ``path``, the directory mkdtemp made in ``parent`` for this test, after
    checking it is that directory."""
    info = os.lstat(path)
    if not (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and os.path.dirname(path) == parent
        and os.path.basename(path).startswith(prefix)
    ):
        raise RuntimeError(f"refusing to remove {path}: not the directory made here")
    shutil.rmtree(path)


def launch(**kwargs) -> list[dict]:
    """The engine's ranks launched here, from a ``cpu_engine`` in ``engine``."""
    server_args = rank_probe.server_args(**kwargs.pop("engine"))
    return rank_probe.launch(server_args, timeout=120, **kwargs)


def cpus(row: dict) -> list[int]:
    report = row.get("report")
    assert "error" not in row and report and row["exitcode"] == 0, row
    assert report["thread_cpus"] == [report["cpus"]], report
    return report["cpus"]


def naming_rank(warnings: list[str], gpu_id: int) -> list[str]:
    return [w for w in warnings if re.search(rf"\b(GPU|rank) {gpu_id}\b", w)]


def run_launcher(job: dict, *, env: dict, prefix: tuple[str, ...] = ()) -> list[dict]:
    """``job`` run by a launching process of its own (its command after ``prefix``)."""
    import json

    done = subprocess.run(
        [*prefix, sys.executable, str(LAUNCHER)],
        input=json.dumps(job),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = rank_probe.parse_results(done.stdout)
    for result in results:
        result["stderr"] = done.stderr[-4000:]
    return results


# Placed ranks.


def test_cpu_ranks_start_on_their_cpus_and_node_0s_memory(spawning, monkeypatch):
    monkeypatch.setenv(OMP, f"{REAL[0]}|{REAL[1]}")
    rows = launch(engine=cpu_engine(tp_size=2))
    assert [cpus(row) for row in rows] == [[REAL[0]], [REAL[1]]]
    for row in rows:
        report = row["report"]
        assert (report["policy"], report["policy_nodes"]) == ("bind", [0]), report
        assert report["mems"] == [0], report


def test_all_on_a_one_node_host_places_nothing(spawning, monkeypatch):
    """SGLANG_CPU_OMP_THREADS_BIND=all (the default) gives rank i the i-th node: on a
    one-node host there is nothing to choose, and the rank keeps this process's CPUs."""
    monkeypatch.delenv(OMP, raising=False)
    (row,) = launch(engine=cpu_engine(tp_size=1))
    assert cpus(row) == REAL
    assert row["report"]["policy"] == "default", row


def test_ranks_spawned_from_threads_at_once_each_get_their_own(spawning, monkeypatch):
    """The data-parallel controller starts each dp rank's schedulers from a thread of
    its own: four threads enter configure_subprocess at once, three times over."""
    monkeypatch.setenv(OMP, "|".join(str(REAL[i % 2]) for i in range(4)))
    for _ in range(3):
        rows = launch(engine=cpu_engine(dp_size=4), threads=True)
        assert [row["gpu_id"] for row in rows] == [0, 1, 2, 3]
        assert [cpus(row) for row in rows] == [[REAL[i % 2]] for i in range(4)]
    assert not os.listdir(spawning), "a wrapper was left in TMPDIR"


def test_the_wrapper_is_private_quoted_and_gone(spawning, monkeypatch):
    """The spawn executable configure_subprocess sets: a program only this user may
    read or run, in a directory of its own in TMPDIR, that runs an interpreter whose
    path holds spaces and shell syntax; nothing of it is left once the rank runs."""
    monkeypatch.setenv(OMP, f"{REAL[0]}|{REAL[1]}")
    venv = spawning.parent / "venv $(false) 'q'"
    for sub in ("bin", "lib/python3.11"):
        (venv / sub).mkdir(parents=True)
    prefix = Path(sys.prefix)
    shutil.copy(prefix / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "bin/python").symlink_to(sys.executable)
    site = "lib/python3.11/site-packages"
    (venv / site).symlink_to(prefix / site)
    server_args = rank_probe.server_args(**cpu_engine(tp_size=2))
    from multiprocessing import resource_tracker

    from sglang.srt.utils import numa_utils

    resource_tracker.ensure_running()  # see rank_probe.launch
    saved = multiprocessing.spawn.get_executable()
    multiprocessing.spawn.set_executable(str(venv / "bin/python"))
    reader, writer = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.Process(target=rank_probe.report_rank, args=(writer,))
    try:
        with numa_utils.configure_subprocess(server_args, 1):
            wrapper = Path(os.fsdecode(multiprocessing.spawn.get_executable()))
            assert wrapper.parent.parent == spawning, wrapper
            for path in (wrapper, wrapper.parent):
                info = path.lstat()
                assert info.st_uid == os.geteuid(), path
                assert stat.S_IMODE(info.st_mode) & 0o077 == 0, (path, info)
            proc.start()
        writer.close()
        assert reader.poll(120), "the rank did not report"
        report = reader.recv()
    finally:
        multiprocessing.spawn.set_executable(saved)
        if proc.pid is not None:
            proc.join(60)
        reader.close()
    assert report["cpus"] == [REAL[1]] and proc.exitcode == 0, report
    assert not os.listdir(spawning), os.listdir(spawning)


# Ranks that cannot be bound as intended.


@pytest.fixture
def path_without_numactl(spawning) -> str:
    """A PATH holding every program of this one but numactl."""
    return fakehost.path_without_numactl(spawning.parent / "bin")


def test_without_numactl_the_rank_runs_unbound_with_one_warning(
    spawning, monkeypatch, path_without_numactl
):
    monkeypatch.setenv(OMP, f"{REAL[0]}|{REAL[1]}")
    monkeypatch.setenv("PATH", path_without_numactl)
    with rank_probe.WarningLog() as log:
        (row,) = launch(engine=cpu_engine(tp_size=2), gpu_ids=[1])
    assert cpus(row) == REAL
    named = naming_rank(log.messages, 1)
    assert len(named) == 1 and "numactl" in named[0], log.messages


def test_a_failed_binding_is_an_error_before_the_rank_starts(
    spawning, monkeypatch, path_without_numactl
):
    monkeypatch.setenv(OMP, f"{REAL[0]}|{REAL[1]}")
    monkeypatch.setenv("PATH", path_without_numactl)
    monkeypatch.setenv("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", "1")
    (row,) = launch(engine=cpu_engine(tp_size=2), gpu_ids=[1])
    assert not row["started"] and "numactl" in row.get("error", ""), row


def test_seccomp_denied_memory_policy_keeps_the_cpus_with_one_warning():
    """A seccomp filter (as a container runtime's) fails set_mempolicy and mbind with
    EPERM in the launching process, numactl and the rank: the ladder ends at the rank's
    CPUs, with one warning naming the rank."""
    job = {
        "deny_memory_policy": True,
        "scenarios": [dict(name="seccomp", engine=cpu_engine(tp_size=2))],
    }
    (result,) = run_launcher(job, env={OMP: f"{REAL[0]}|{REAL[1]}"})
    assert "error" not in result, result
    assert [cpus(row) for row in result["ranks"]] == [[REAL[0]], [REAL[1]]]
    for gpu_id, row in enumerate(result["ranks"]):
        assert row["report"]["policy"] == "default", row
        assert len(naming_rank(result["warnings"], gpu_id)) == 1, result["warnings"]


def test_noexec_tmpdir_the_rank_binds_itself_in_configure_scheduler_process():
    """Regression (3113a40 started the rank unbound). TMPDIR is a tmpfs mounted noexec
    (in a private mount namespace), so the numactl wrapper cannot run: the rank, sglang's
    own run_scheduler_process, binds itself in configure_scheduler_process."""
    if os.geteuid() != 0:
        pytest.skip("mounts a noexec tmpfs in a private mount namespace: run as root")
    mount = 'mount -t tmpfs -o noexec,nosuid,nodev,mode=0700 tmpfs "$1" || exit 97'
    parent = tempfile.gettempdir()
    private = tempfile.mkdtemp(prefix="test-noexec-", dir=parent)
    try:
        prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c")
        prefix += (f'{mount}; shift; exec "$@"', "sh", private)
        job = {
            "scenarios": [
                dict(
                    name="noexec",
                    engine=cpu_engine(tp_size=2),
                    gpu_ids=[1],
                    rank="scheduler",
                )
            ],
            "timeout": 600,
        }
        env = {OMP: f"{REAL[0]}|{REAL[1]}", "TMPDIR": private}
        (result,) = run_launcher(job, env=env, prefix=prefix)
        assert not os.listdir(private)
    finally:
        remove_private(private, parent=parent, prefix="test-noexec-")
    (row,) = result["ranks"]
    assert cpus(row) == [REAL[1]], result
    report = row["report"]
    assert report["title"].startswith("sglang::scheduler_TP1"), report
    assert report["policy"] in ("bind", "preferred"), report
    assert report["policy_nodes"] == [0], report
    named = [w for w in naming_rank(result["warnings"], 1) if "noexec" in w]
    assert len(named) == 1 and private in named[0], result


def test_the_first_spawn_of_a_fresh_process_starts_its_rank():
    """An engine's first scheduler is its process's first spawn, which also starts
    multiprocessing's resource tracker with the spawn executable then in force: each of
    eight first spawns (the tracker stopped before each) starts its rank."""
    scenario = dict(engine=cpu_engine(tp_size=2), gpu_ids=[1], first_spawn=True)
    job = {"scenarios": [dict(scenario, name=f"first spawn {i}") for i in range(8)]}
    results = run_launcher(job, env={OMP: f"{REAL[0]}|{REAL[1]}"})
    exits = [[row.get("exitcode") for row in r["ranks"]] for r in results]
    assert exits == [[0]] * 8, (exits, results[0]["stderr"][-2000:])
    assert all(cpus(r["ranks"][0]) == [REAL[1]] for r in results)


# Bad input.


@pytest.mark.parametrize(
    "value, tp_size",
    [
        ("0-x|1", 2),  # not a number
        ("|1", 2),  # an empty group
        ("1-0|0", 2),  # a range backwards
        ("0|99999", 2),  # a CPU this process may not use
        ("0|1", 3),  # fewer groups than ranks
    ],
)
def test_a_bad_cpu_omp_threads_bind_is_an_error_naming_it(
    spawning, monkeypatch, value, tp_size
):
    monkeypatch.setenv(OMP, value)
    rows = launch(engine=cpu_engine(tp_size=tp_size))
    bad = [row for row in rows if "error" in row]
    assert bad and all(not row["started"] for row in bad), rows
    assert all(OMP in row["error"] for row in bad), bad
