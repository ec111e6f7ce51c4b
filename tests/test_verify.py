"""verify --launcher mp: probe ranks started as sglang's engine starts schedulers, each reading its binding back."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from spawn_support import args, numactl_standin

from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity
from sglang.srt.placement_tools.verify import (
    ObservedBinding,
    differences,
    format_verify_rows,
    run_mp_probes,
    verify_mp,
)

CPUS = sorted(os.sched_getaffinity(0))
PLAN_FIELDS = (
    "dp_rank",
    "pp_rank",
    "tp_rank",
    "gpu_id",
    "numa_node",
    "cpus",
    "mem_policy",
    "strategy",
    "reasons",
)
OBSERVED_FIELDS = (
    "launcher",
    "observed_cpus",
    "observed_mems",
    "observed_policy",
    "local_page_ratio",
    "ok",
    "differences",
)


@pytest.fixture
def cpu_groups(monkeypatch):
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{CPUS[0]}|{CPUS[1]}")


@pytest.mark.parametrize("dp_threads", [False, True])
def test_ranks_spawned_inside_configure_subprocess_are_where_plan_says(
    cpu_groups, dp_threads
):
    rows = verify_mp(
        args(device="cpu", tp_size=1, dp_size=2), timeout_s=120, dp_threads=dp_threads
    )
    json.dumps({"ranks": rows})
    assert all(set(PLAN_FIELDS + OBSERVED_FIELDS) <= set(row) for row in rows)
    assert [
        (
            row["dp_rank"],
            row["strategy"],
            row["observed_cpus"],
            row["observed_policy"],
            row["ok"],
        )
        for row in rows
    ] == [
        (0, "exec", str(CPUS[0]), "bind:0", True),
        (1, "exec", str(CPUS[1]), "bind:0", True),
    ]
    assert len({row["observed_pid"] for row in rows}) == 2


def test_a_launch_that_bypasses_configure_subprocess_is_caught(cpu_groups, monkeypatch):
    """verify fails when the ranks are not started through sglang's configure_subprocess."""
    from sglang.srt.utils import numa_utils

    bypass = lambda server_args, gpu_id: contextlib.nullcontext()  # noqa: E731
    monkeypatch.setattr(numa_utils, "configure_subprocess", bypass)
    rows = verify_mp(args(device="cpu", tp_size=2), timeout_s=120)
    assert [row["ok"] for row in rows] == [False, False]
    assert all(
        "cpus" in row["differences"][0] and "planned" in row["differences"][0]
        for row in rows
    )
    assert "MISMATCH" in format_verify_rows(rows)


def test_unbound_ranks_must_have_been_left_alone():
    plan = ProcessPlacement(
        rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0),
        pci=None,
        numa_node=None,
        cpus=frozenset(),
        mem_nodes=frozenset(),
        mem_policy="none",
        strategy="none",
        reasons=("one node",),
    )
    observed = ObservedBinding(
        cpus=frozenset({0}),
        mems=frozenset({0}),
        policy="bind",
        policy_nodes=frozenset({0}),
    )
    assert differences(plan, observed, unbound_cpus=frozenset({0, 1})) == [
        "cpus 0 observed, the launcher's 0-1 expected for an unbound rank",
        "memory policy bind observed, default expected for an unbound rank",
    ]


def test_page_ratio_thresholds():
    exec_rank = ProcessPlacement(
        rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0),
        pci=None,
        numa_node=0,
        cpus=frozenset({0}),
        mem_nodes=frozenset({0}),
        mem_policy="bind",
        strategy="exec",
        reasons=(),
    )

    def observed(on_node: int, off_node: int) -> ObservedBinding:
        return ObservedBinding(
            cpus=frozenset({0}),
            mems=frozenset({0, 1}),
            policy="bind",
            policy_nodes=frozenset({0}),
            anon_kb=((0, on_node), (1, off_node)),
        )

    assert differences(exec_rank, observed(995, 5), unbound_cpus=frozenset()) == []
    assert differences(exec_rank, observed(98, 2), unbound_cpus=frozenset()) == [
        "98.0% of the rank's resident anonymous memory is on node(s) 0, at least 99% expected for strategy exec"
    ]
    in_process = dataclasses.replace(exec_rank, strategy="in-process")
    assert differences(in_process, observed(96, 4), unbound_cpus=frozenset()) == []


def test_a_probe_that_never_reports_ends_at_the_deadline_and_is_stopped(
    cpu_groups, monkeypatch, tmp_path
):
    directory, _ = numactl_standin(tmp_path / "numactl", "hang")
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"DP0 PP0 TP0.*no report within 3 s"):
        run_mp_probes(args(device="cpu", tp_size=2), timeout_s=3)
    assert time.monotonic() - started < 60
    hanging = subprocess.run(
        ["pgrep", "-f", f"{directory}/numactl"], capture_output=True, text=True
    )
    assert hanging.stdout.strip() == "", "verify left a probe rank running"


def test_verify_cli_exits_1_on_a_mismatch_and_0_when_all_agree(cpu_groups, tmp_path):
    command = [
        sys.executable,
        "-m",
        "sglang.srt.placement_tools",
        "verify",
        "--device",
        "cpu",
        "--tp-size",
        "2",
        "--json",
    ]
    ok = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert [row["ok"] for row in json.loads(ok.stdout)["ranks"]] == [True, True]
    # A numactl that accepts every option and binds nothing: the ranks are not where the plan says.
    directory, _ = numactl_standin(tmp_path / "numactl", "record")
    env = {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}
    off = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert off.returncode == 1, off.stderr[-2000:]
    assert [row["ok"] for row in json.loads(off.stdout)["ranks"]] == [False, False]


@pytest.mark.parametrize(
    "flag", ["--sysfs-root=/sys", "--allowed-cpus=0", "--gpus=0000:17:00.0"]
)
def test_verify_refuses_planning_inputs_that_sglang_does_not_take(flag):
    done = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "verify", flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2 and "sglang's launch path does not take" in done.stderr
    ), done.stderr


@pytest.mark.parametrize("mode", ["refuse-all", "no-libnuma"])
def test_verify_agrees_with_sglangs_path_when_numactl_cannot_bind(
    cpu_groups, monkeypatch, tmp_path, mode
):
    """A numactl that seccomp refuses, or one without libnuma: plan says unbound, and the ranks are."""
    directory, _ = numactl_standin(tmp_path / "numactl", mode)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    rows = verify_mp(args(device="cpu", tp_size=2), timeout_s=120)
    assert [(row["strategy"], row["degraded"], row["ok"]) for row in rows] == [
        ("none", True, True)
    ] * 2
    assert [row["observed_cpus"] for row in rows] == [f"{CPUS[0]}-{CPUS[-1]}"] * 2


def test_verify_agrees_with_sglangs_path_without_numactl(cpu_groups, monkeypatch):
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d]
    without = [d for d in path if not os.path.exists(os.path.join(d, "numactl"))]
    monkeypatch.setenv("PATH", os.pathsep.join(without))
    rows = verify_mp(args(device="cpu", tp_size=2), timeout_s=120)
    assert [(row["strategy"], row["ok"]) for row in rows] == [("none", True)] * 2
    assert all("numactl is not installed" in " ".join(row["reasons"]) for row in rows)


def test_verify_under_the_crash_setting_fails_in_one_line_naming_the_rank(cpu_groups):
    """sglang's spawn path refuses to start a rank it cannot bind: verify fails (status 1), no traceback."""
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d]
    env = {
        **os.environ,
        "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
        "PATH": os.pathsep.join(
            d for d in path if not os.path.exists(os.path.join(d, "numactl"))
        ),
    }
    done = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "verify", "--device", "cpu",
         "--tp-size", "2"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [l for l in done.stderr.splitlines() if l.startswith("error: ")]
    assert "CPU rank 0" in line and "numactl is not installed" in line, line
