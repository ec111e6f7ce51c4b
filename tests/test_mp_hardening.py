"""The multiprocessing launcher under faults: dead or stalled children, killed launchers, exiting threads,
other spawn wrappers, failed waits and cpusets, with real processes, numactl and signals."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang.srt.placement.types import PlacementError
from sglang.srt.scheduler_launch import spawn_hook
from sglang.srt.scheduler_rank.common import RankLaunchError
from sglang.srt.scheduler_launch.mp import launch_scheduler_processes, shutdown_ranks, wait_finished, wait_ready
from sglang.srt.placement.engine_args import EngineArgs

from mp_launch_targets import exec_placement, raising_target, sleeping_loop_target, unbound_placement

SCENARIOS = Path(__file__).resolve().parent / "mp_scenarios.py"
SCENARIO_TIMEOUT_S = 40


@pytest.fixture(autouse=True, scope="module")
def _host_has_what_these_tests_need():
    assert len(os.sched_getaffinity(0)) >= 2, "these tests need at least 2 CPUs"


def run_scenario(*args: str, env: dict | None = None) -> tuple[dict, str]:
    """Run one scenario of mp_scenarios.py in a fresh interpreter; its JSON line and its stderr."""
    proc = subprocess.run(
        [sys.executable, str(SCENARIOS), *args], capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def process_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's zombie may wait for an init that never reaps)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# --------------------------------------------------------------------------- 1. a launch ends within its deadline


def test_refusal_after_the_probe_with_large_args_fails_fast():
    # The probe's answer is cached; then this process's affinity narrows to CPU 0 and the rank is
    # placed on CPU 1 with 200 KB of arguments: numactl refuses, and the launch says so at once.
    out, _ = run_scenario("narrowed_affinity")
    assert out["ok"] is False
    assert out["elapsed_s"] < 8
    assert out["label"] == "DP0 PP0 TP0"
    assert out["message"].startswith("DP0 PP0 TP0: numactl refused to start the scheduler (exit status 1): ")
    assert "cpu argument 1" in out["message"]


def test_child_dying_before_it_reads_large_args_is_reported_with_its_rank():
    out, _ = run_scenario("prefix_fault", "exit", "10")
    assert out["ok"] is False
    assert out["elapsed_s"] < 8
    assert out["label"] == "DP0 PP0 TP0"
    assert "DP0 PP0 TP0: scheduler process" in out["message"]
    assert "died while starting with exit status 3 before it read its arguments" in out["message"]


def test_child_stalled_before_it_reads_large_args_ends_at_the_deadline():
    out, _ = run_scenario("prefix_fault", "stall", "2")
    assert out["ok"] is False
    assert 2 <= out["elapsed_s"] < 8
    assert out["label"] == "DP0 PP0 TP0"
    assert out["message"].startswith("DP0 PP0 TP0: no readiness report within 2 s")


# --------------------------------------------------------------------------- 2. the spawn hook and other wrappers


def test_spawn_hook_chains_with_other_wrappers_from_many_threads():
    out, stderr = run_scenario("hook_chain")
    assert out["errors"] == [], stderr[-3000:]
    assert out["cpus"] == {"placed": ["1"] * 4, "unbound": [out["cpus"]["unbound"][0]] * 3}
    assert out["cpus"]["unbound"][0] != "1"
    # The wrapper installed after the hook saw each of the 6 later spawns once, without numactl in front;
    # the one installed before it saw all 7, the 4 placed ones under numactl.
    assert len(out["above"]) == 6
    assert not any(program.endswith("numactl") for program in out["above"])
    assert len(out["below"]) == 7
    assert sum(program.endswith("numactl") for program in out["below"]) == 4
    assert out["top_is_above"]
    assert out["hook_installed"]  # seen through the wrapper's __wrapped__


def test_spawn_hook_refuses_a_chain_that_leads_back_to_it(monkeypatch):
    # A wrapper below the hook that calls whatever spawnv_passfds is current, rather than the
    # function it replaced, would bring every spawn back into the hook: a clear error, not a RecursionError.
    monkeypatch.setattr(spawn_hook, "_original_spawnv_passfds", spawn_hook._placed_spawnv_passfds)
    with pytest.raises(PlacementError, match="leads back into sglang's spawn hook"):
        spawn_hook._placed_spawnv_passfds(b"/bin/true", ["/bin/true"], [])


# --------------------------------------------------------------------------- 3. a rank follows its launcher process


@pytest.mark.parametrize("where", ["main", "thread"])
def test_rank_does_not_outlive_a_launcher_killed_while_it_starts(where):
    launcher = subprocess.Popen(
        [sys.executable, str(SCENARIOS), "killed_launcher", where], stdout=subprocess.PIPE, text=True,
    )
    pid = None
    try:
        pid = json.loads(launcher.stdout.readline())["pid"]
        time.sleep(0.1)
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while process_running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_running(pid), f"rank {pid} outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if pid is not None and process_running(pid):
            os.kill(pid, signal.SIGKILL)


def test_ranks_outlive_the_pool_thread_that_launched_them():
    def launch(placement):
        launched = launch_scheduler_processes(EngineArgs(), target=sleeping_loop_target, placements=[placement])
        wait_ready(launched, timeout_s=60)
        return launched

    with ThreadPoolExecutor(max_workers=2) as pool:
        engines = list(pool.map(launch, [exec_placement(0, 0), unbound_placement(0)]))
    # The pool's threads have exited; the ranks they started run their event loops out.
    try:
        for launched in engines:
            assert all(r.info is not None for r in launched)
            wait_finished(launched, timeout_s=60)
    finally:
        for launched in engines:
            shutdown_ranks(launched)


# --------------------------------------------------------------------------- 4. shutdown_ranks is idempotent


def test_shutdown_after_a_failed_wait_keeps_the_real_error():
    launched = launch_scheduler_processes(EngineArgs(), target=raising_target, placements=[unbound_placement(0)])
    with pytest.raises(RankLaunchError, match="DP0 PP0 TP0: scheduler failed to start: ValueError: model weights"):
        try:
            wait_ready(launched, timeout_s=60)
        finally:
            shutdown_ranks(launched)
    shutdown_ranks(launched)


# --------------------------------------------------------------------------- 5. the child reads its binding back


@contextlib.contextmanager
def narrow_cpuset(cpus: str):
    """A cpuset cgroup that allows only ``cpus`` (cgroup v1, or v2 with the cpuset controller enabled)."""
    name = f"sglang-mp-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for base, parent_mems in (("/sys/fs/cgroup/cpuset", "cpuset.mems"), ("/sys/fs/cgroup", "cpuset.mems.effective")):
        if os.path.exists(os.path.join(base, "cpuset.cpus" if base.endswith("cpuset") else "cgroup.subtree_control")):
            break
    else:
        raise RuntimeError("this test needs a cpuset cgroup (cgroup v1 cpuset or v2 with cpuset) it can create")
    if base == "/sys/fs/cgroup":
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            if "cpuset" not in f.read().split():
                raise RuntimeError("this test needs the cpuset controller enabled in /sys/fs/cgroup/cgroup.subtree_control")
    path = os.path.join(base, name)
    with open(os.path.join(base, parent_mems)) as f:
        mems = f.read().strip()
    os.mkdir(path)
    try:
        for key, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems)):
            with open(os.path.join(path, key), "w") as f:
                f.write(value)
        yield path
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


MISMATCH = r"DP0 PP0 TP0: scheduler \(pid \d+\) is not where its placement says \(strategy in-process\): cpus 0 observed, 0-1 planned"


def test_child_in_a_narrower_cpuset_warns_with_its_rank():
    with narrow_cpuset("0") as cgroup:
        out, stderr = run_scenario("cpuset", cgroup, env={"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    assert out["ok"] is True
    assert out["cpus"] == "0"
    assert re.search(MISMATCH, stderr), stderr[-3000:]
    assert out["binding"]["mismatches"][0] == "cpus 0 observed, 0-1 planned"
    assert out["binding"]["observed"]["cpus"] == "0"


def test_child_in_a_narrower_cpuset_fails_under_the_crash_setting():
    with narrow_cpuset("0") as cgroup:
        out, _ = run_scenario("cpuset", cgroup, env={"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"})
    assert out["ok"] is False
    assert out["label"] == "DP0 PP0 TP0"
    assert out["message"].startswith("DP0 PP0 TP0: scheduler failed to start: PlacementError: ")
    assert re.search(MISMATCH, out["message"])
    assert "SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1" in out["message"]
