"""The multiprocessing launcher with real spawn, real numactl and real children on this host."""

from __future__ import annotations

import json
import multiprocessing.spawn
import multiprocessing.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sglang.srt.placement import numactl
from sglang.srt.scheduler_launch.mp import run_ranks_mp
from sglang.srt.scheduler_launch.spawn_hook import armed_prefix, spawn_hook_installed, spawn_with_prefix
from sglang.srt.environ import envs
from sglang.srt.scheduler_rank.common import RankLaunchError
from sglang.srt.placement.types import PlacementError
from sglang.srt.placement.engine_args import EngineArgs

from mp_launch_targets import (
    exec_placement,
    exiting_target,
    failing_loop_target,
    hanging_target,
    in_process_placement,
    raising_target,
    report_target,
    unbound_placement,
)

REPO = Path(__file__).resolve().parents[1]
ALL_CPUS = sorted(os.sched_getaffinity(0))
NUMACTL = shutil.which("numactl")


@pytest.fixture(autouse=True, scope="module")
def _host_has_what_these_tests_need():
    assert NUMACTL is not None, "these tests need numactl on PATH (apt-get install numactl)"
    assert len(ALL_CPUS) >= 2, "these tests need at least 2 CPUs"


# --------------------------------------------------------------------------- helpers


def scheduler_children() -> list[int]:
    """Live children of this process that are spawned schedulers (the resource tracker is left out)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z" and (b"spawn_main" in cmdline or b"numactl" in cmdline):
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def _no_children_left():
    yield
    assert scheduler_children() == []
    assert armed_prefix() is None


# --------------------------------------------------------------------------- placement reaches the child


def test_two_exec_ranks_each_run_on_their_own_cpu():
    results = run_ranks_mp(
        EngineArgs(tp_size=2), target=report_target, placements=[exec_placement(0, 0), exec_placement(1, 1)],
        timeout_s=120,
    )
    assert [r.rank.tp_rank for r in results] == [0, 1]
    assert [r.info["cpus"] for r in results] == ["0", "1"]
    assert all(r.info["policy"] == "bind" and r.info["policy_nodes"] == [0] for r in results)
    assert len({r.info["pid"] for r in results}) == 2
    # Each rank read its binding back and sent it with its readiness: where it is, and no mismatch.
    assert [(r.binding["pid"], r.binding["observed"]["cpus"], r.binding["mismatches"]) for r in results] == [
        (r.info["pid"], r.info["cpus"], []) for r in results
    ]


def test_in_process_and_unbound_ranks():
    results = run_ranks_mp(
        EngineArgs(tp_size=2), target=report_target, placements=[in_process_placement(0, 1), unbound_placement(1)],
        timeout_s=120,
    )
    assert results[0].info["cpus"] == "1"
    assert results[0].info["policy"] == "bind"
    assert results[1].info["cpus"] == f"{ALL_CPUS[0]}-{ALL_CPUS[-1]}"
    assert results[1].info["policy"] == "default"


def test_numactl_missing_at_launch_binds_in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    (result,) = run_ranks_mp(EngineArgs(), target=report_target, placements=[exec_placement(0, 1)], timeout_s=120)
    assert result.placement.strategy == "in-process"
    assert "numactl was not found at launch" in result.placement.reasons[-1]
    assert result.info["cpus"] == "1"
    assert result.info["policy"] == "bind"


def test_numactl_missing_at_launch_is_fatal_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True), pytest.raises(PlacementError, match="numactl"):
        run_ranks_mp(EngineArgs(), target=report_target, placements=[exec_placement(0, 1)], timeout_s=120)


def test_planned_cpu_ranks_through_the_launcher():
    from sglang.srt.placement.resolve import plan_engine

    server_args = EngineArgs(device="cpu", tp_size=2)
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        plan = plan_engine(server_args, launcher="mp")
        results = run_ranks_mp(server_args, target=report_target, timeout_s=120)
    assert [p.strategy for p in plan] == ["exec", "exec"]
    assert [r.info["cpus"] for r in results] == ["0", "1"]
    assert [r.rank.global_rank for r in results] == [0, 1]


# --------------------------------------------------------------------------- faults


def test_numactl_refusal_is_caught_before_the_spawn():
    with pytest.raises(RankLaunchError) as info:
        run_ranks_mp(
            EngineArgs(tp_size=2), target=report_target,
            placements=[exec_placement(0, 0), exec_placement(1, 1, membind=7)], timeout_s=120,
        )
    message = str(info.value)
    assert message.startswith("DP0 PP0 TP1: numactl refused to start the scheduler: ")
    assert "out of range" in message
    assert "--membind=7" in message
    assert info.value.label == "DP0 PP0 TP1"


def test_child_that_numactl_kills_is_reported_with_its_message(monkeypatch):
    # Past the dry run (a race, or a refusal only the real start meets), the child dies before Python
    # starts: its sentinel ends the wait and numactl's own words are fetched again.
    monkeypatch.setattr(numactl, "exec_refusal", lambda placement: None)
    with pytest.raises(RankLaunchError) as info:
        run_ranks_mp(
            EngineArgs(tp_size=2), target=report_target,
            placements=[exec_placement(0, 0), exec_placement(1, 1, membind=7)], timeout_s=120,
        )
    message = str(info.value)
    assert message.startswith("DP0 PP0 TP1: numactl refused to start the scheduler (exit status 1): ")
    assert "out of range" in message
    assert "--membind=7" in message
    assert "usage:" not in message


def test_target_error_carries_the_child_traceback():
    with pytest.raises(RankLaunchError) as info:
        run_ranks_mp(EngineArgs(), target=raising_target, placements=[exec_placement(0, 0)], timeout_s=120)
    assert "DP0 PP0 TP0: scheduler failed to start: ValueError: model weights missing for DP0 PP0 TP0" in str(info.value)
    assert "build_scheduler_that_fails" in info.value.child_traceback
    assert "Traceback (most recent call last)" in str(info.value)


def test_child_exiting_without_a_report():
    with pytest.raises(RankLaunchError, match="died while starting with exit status 3"):
        run_ranks_mp(EngineArgs(), target=exiting_target, placements=[exec_placement(0, 1)], timeout_s=120)


def test_no_readiness_before_the_deadline_stops_every_rank():
    with pytest.raises(RankLaunchError, match="no readiness report within 3 s"):
        run_ranks_mp(
            EngineArgs(tp_size=2), target=hanging_target, placements=[exec_placement(0, 0), unbound_placement(1)],
            timeout_s=3,
        )


def test_event_loop_failure_is_reported():
    with pytest.raises(RankLaunchError, match="failed while running: RuntimeError: event loop lost its socket"):
        run_ranks_mp(EngineArgs(), target=failing_loop_target, placements=[unbound_placement(0)], timeout_s=120)


def test_failed_launch_leaves_spawn_state_as_it_was():
    executable = multiprocessing.spawn.get_executable()
    with pytest.raises(RankLaunchError):
        run_ranks_mp(EngineArgs(), target=report_target, placements=[exec_placement(0, 0, membind=7)], timeout_s=120)
    # A launch that fails before the child exists (the target cannot be pickled) restores too.
    with pytest.raises(Exception):
        run_ranks_mp(EngineArgs(), target=lambda **kw: None, placements=[exec_placement(0, 0)], timeout_s=120)
    assert multiprocessing.spawn.get_executable() == executable
    assert armed_prefix() is None
    # The next unplaced spawn is not wrapped by anything left behind.
    (result,) = run_ranks_mp(EngineArgs(), target=report_target, placements=[unbound_placement(0)], timeout_s=120)
    assert result.info["cpus"] == f"{ALL_CPUS[0]}-{ALL_CPUS[-1]}"


def test_concurrent_launches_in_threads_keep_their_own_binding():
    barrier = threading.Barrier(2)
    outcomes: dict[str, list] = {"placed": [], "unbound": []}
    errors: list[BaseException] = []

    def launch(kind: str) -> None:
        try:
            for _ in range(3):
                barrier.wait(timeout=60)
                if kind == "placed":
                    placements = [exec_placement(0, 1), exec_placement(1, 1)]
                else:
                    placements = [unbound_placement(0), unbound_placement(1)]
                results = run_ranks_mp(EngineArgs(tp_size=2), target=report_target, placements=placements, timeout_s=120)
                outcomes[kind].extend(r.info["cpus"] for r in results)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=launch, args=(kind,)) for kind in ("placed", "unbound")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert outcomes["placed"] == ["1"] * 6
    assert outcomes["unbound"] == [f"{ALL_CPUS[0]}-{ALL_CPUS[-1]}"] * 6


def test_hook_only_wraps_spawn_command_lines():
    # Anything else that goes through spawnv_passfds in the armed thread (the resource tracker,
    # a forkserver) starts as asked, outside numactl.
    r, w = os.pipe()
    script = f"import os; os.write({w}, repr(sorted(os.sched_getaffinity(0))).encode())"
    with spawn_with_prefix([NUMACTL, "--physcpubind=0"]):
        assert spawn_hook_installed()
        assert armed_prefix() == (NUMACTL, "--physcpubind=0")
        try:
            pid = multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, "-c", script], [w])
        finally:
            os.close(w)
    with os.fdopen(r) as reader:
        seen = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen == repr(ALL_CPUS)


def test_spawn_with_prefix_nests_and_rejects_an_empty_prefix():
    with spawn_with_prefix([NUMACTL, "--physcpubind=0"]):
        with spawn_with_prefix([NUMACTL, "--physcpubind=1"]):
            assert armed_prefix() == (NUMACTL, "--physcpubind=1")
        assert armed_prefix() == (NUMACTL, "--physcpubind=0")
        with pytest.raises(ValueError, match="non-empty"):
            with spawn_with_prefix([]):
                pass
        assert armed_prefix() == (NUMACTL, "--physcpubind=0")


NOEXEC_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from mp_launch_targets import exec_placement, report_target
from sglang.srt.scheduler_launch.mp import run_ranks_mp
from sglang.srt.placement.engine_args import EngineArgs

with open("/proc/self/mountinfo") as f:
    tmp_options = [line.split()[5] for line in f if line.split()[4] == "/tmp"]
before = sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm"))
results = run_ranks_mp(EngineArgs(tp_size=2), target=report_target,
                       placements=[exec_placement(0, 0), exec_placement(1, 1)], timeout_s=120)
after = sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm"))
print(json.dumps({"tmp_options": tmp_options, "cpus": [r.info["cpus"] for r in results],
                  "before": before, "after": after}))
"""

# Runs as root in a private mount namespace: /tmp becomes a fresh noexec tmpfs and /dev/shm a fresh
# tmpfs, for the launch only, so that their listings show exactly what the launch left there. Folders
# of /tmp that this test itself runs from (a checkout or a virtual environment under /tmp) are bound
# back in at the same path, from the directory the shell sits in before /tmp is covered.
MOUNT_HELPER = r"""
import json, os, subprocess, sys
tops = json.loads(sys.argv[1])
held = {top: os.open(top, os.O_RDONLY | os.O_DIRECTORY) for top in tops}
subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,nosuid,nodev,mode=1777", "sglang-test-tmp", "/tmp"], check=True)
for top, fd in held.items():
    os.mkdir(top, 0o755)
    subprocess.run(["mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{fd}", top], check=True, pass_fds=(fd,))
    os.close(fd)
subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,mode=1777", "sglang-test-shm", "/dev/shm"], check=True)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _tops_under_tmp(paths):
    """The first-level folders of /tmp that hold any of ``paths``."""
    tops = set()
    for path in paths:
        real = os.path.realpath(path)
        if real.startswith("/tmp/"):
            tops.add("/tmp/" + real.split("/")[2])
    return sorted(tops)


def test_launch_works_with_noexec_tmp_and_leaves_no_files():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        raise RuntimeError("this test needs root and unshare(1) to mount a private noexec /tmp")
    tops = _tops_under_tmp([REPO, sys.prefix, sys.executable, Path(__file__).parent])
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", MOUNT_HELPER,
         json.dumps(tops), sys.executable, "-c", NOEXEC_SCRIPT, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=180, cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("noexec" in opt for opt in out["tmp_options"])
    assert out["cpus"] == ["0", "1"]
    assert out["before"] == [[os.path.basename(t) for t in tops], []]
    assert out["after"] == out["before"]
