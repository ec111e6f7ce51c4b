"""The Ray launcher on a real local Ray cluster: exec and in-process placement, read-back, faults, cleanup.

Every test shares the session's 2-CPU cluster (``ray_cluster``); a launch of
two CPU-device ranks holds both CPUs, so launches run one after another and
each must give its CPUs back.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time

import pytest
import ray
from ray import cloudpickle

import ray_helpers
from sglang.srt.environ import envs
from sglang.srt.scheduler_rank.common import RankLaunchError
from sglang.srt.scheduler_launch.ray_launcher import (
    ACTOR_NAME_PREFIX,
    SHUTDOWN_WAIT_S,
    launch_scheduler_actors,
    run_ranks_ray,
    shutdown_ray,
    wait_ready_ray,
)
from sglang.srt.placement.engine_args import EngineArgs

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(ray_helpers)

TIMEOUT_S = 120.0


def cpu_args(tp_size: int = 2) -> EngineArgs:
    return EngineArgs(tp_size=tp_size, device="cpu")


def our_actors() -> list[str]:
    return [name for name in ray.util.list_named_actors() if name.startswith(ACTOR_NAME_PREFIX)]


def assert_nothing_left(launch=None) -> None:
    assert our_actors() == []
    if launch is not None:
        table = ray.util.placement_group_table(launch.placement_group)
        assert table["state"] == "REMOVED"


@pytest.fixture
def cluster(ray_cluster):
    yield ray_cluster
    # A test that left anything running would starve the next one of CPUs.
    assert_nothing_left()


# ----------------------------------------------------------------------------- exec


def test_exec_with_the_real_resolver_binds_each_cpu_rank_to_its_omp_group(cluster):
    assert shutil.which("numactl"), "numactl must be installed for the exec path"
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        results = run_ranks_ray(cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S)
    assert [r.rank.tp_rank for r in results] == [0, 1]
    for r in results:
        tp = r.rank.tp_rank
        p = r.placement
        assert p.launcher == "ray"
        assert p.strategy == "exec", p.reasons
        assert p.numactl_args == (f"--physcpubind={tp}", "--membind=0")
        assert p.cpus == frozenset({tp}) and p.mem_nodes == frozenset({0})
        # Every thread of the worker (Ray starts about twenty) is on the rank's CPU.
        assert r.info["thread_cpu_sets"] == [str(tp)]
        assert r.info["threads"] > 1
        assert r.info["mems_allowed"] == "0"
        # The driver's setting reached the node that resolved and runs the rank.
        assert r.info["omp_bind_env"] == "0|1"
    assert results[0].info["pid"] != results[1].info["pid"]


def test_exec_actor_reads_back_a_binding_that_matches(cluster):
    launch = launch_scheduler_actors(
        cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S, planner=ray_helpers.hand_planner
    )
    try:
        results = wait_ready_ray(launch, timeout_s=TIMEOUT_S)
        for a, r in zip(launch.actors, results):
            assert a.py_executable == f"{shutil.which('numactl')} --physcpubind={a.rank.tp_rank} --membind=0 {sys.executable}"
            assert a.binding["mismatches"] == []
            # bash and numactl exec'd in place: the raylet's own child is the bound worker, no wrapper between.
            assert r.info["parent"] == "raylet"
            # Resolved in a Ray worker on the actor's node, not in this driver.
            assert a.placement.reasons[0].startswith("hand-made on pid ")
            assert a.placement.reasons[0] != f"hand-made on pid {os.getpid()}"
            observed = a.binding["observed"]
            assert observed["cpus"] == str(a.rank.tp_rank)
            assert observed["policy"] == "bind"
    finally:
        shutdown_ray(launch)
    assert_nothing_left(launch)


def test_exec_that_numactl_refuses_falls_back_to_in_process_with_the_reason(cluster):
    results = run_ranks_ray(
        cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S, planner=ray_helpers.refused_planner
    )
    for r in results:
        assert r.placement.strategy == "in-process"
        assert r.placement.numactl_args == ()
        assert any("--membind=7 does not start on this node" in why for why in r.placement.reasons), r.placement.reasons
        assert r.info["thread_cpu_sets"] == [str(r.rank.tp_rank)]


# ----------------------------------------------------------------------------- in-process


def test_forced_in_process_binds_every_thread_of_the_worker(cluster):
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        launch = launch_scheduler_actors(
            cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S, force_in_process=True
        )
        try:
            results = wait_ready_ray(launch, timeout_s=TIMEOUT_S)
        finally:
            shutdown_ray(launch)
    assert_nothing_left(launch)
    for a, r in zip(launch.actors, results):
        tp = a.rank.tp_rank
        assert a.py_executable is None
        assert r.placement.strategy == "in-process", r.placement.reasons
        assert r.placement.cpus == frozenset({tp})
        assert "the ray launcher cannot start this rank under numactl" in r.placement.reasons
        assert r.info["threads"] > 1
        assert r.info["thread_cpu_sets"] == [str(tp)]
        assert a.binding["mismatches"] == []
        assert a.binding["observed"]["policy"] == "bind"
        assert a.binding["observed"]["policy_nodes"] == "0"


# ----------------------------------------------------------------------------- read-back


def test_actor_not_where_its_placement_says_is_reported(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="sglang.srt.scheduler_launch.ray_launcher")
    launch = launch_scheduler_actors(
        cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S, planner=ray_helpers.lying_planner
    )
    try:
        wait_ready_ray(launch, timeout_s=TIMEOUT_S)
    finally:
        shutdown_ray(launch)
    for a in launch.actors:
        planned, actual = a.rank.tp_rank, 1 - a.rank.tp_rank
        assert f"cpus {actual} observed, {planned} planned" in a.binding["mismatches"]
        assert any("threads may run outside the planned CPUs" in m for m in a.binding["mismatches"])
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    for a in launch.actors:
        assert any(w.startswith(f"{a.label}: scheduler actor {a.name}") and "is not where its placement says" in w
                   for w in warnings), warnings


def test_actor_not_where_its_placement_says_fails_the_launch_under_crash_setting(cluster):
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True):
        with pytest.raises(RankLaunchError) as info:
            run_ranks_ray(cpu_args(tp_size=1), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S,
                          planner=ray_helpers.lying_planner)
    message = str(info.value)
    assert "scheduler actor failed to initialise: PlacementError" in message
    assert "is not where its placement says" in message
    assert "SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal" in message
    assert info.value.label == "DP0 PP0 TP0"
    assert "cpus 1 observed, 0 planned" in message


# ----------------------------------------------------------------------------- faults and cleanup


def test_actor_raising_in_init_fails_the_launch_naming_the_rank_and_leaves_nothing(cluster):
    with pytest.raises(RankLaunchError) as info:
        run_ranks_ray(cpu_args(), target=ray_helpers.failing_target, timeout_s=TIMEOUT_S,
                      planner=ray_helpers.hand_planner)
    err = info.value
    assert err.label == "DP0 PP0 TP1"
    assert str(err).startswith("DP0 PP0 TP1: scheduler actor failed to initialise: ValueError: boom in the constructor of TP1")
    assert err.error == "ValueError: boom in the constructor of TP1"
    assert "failing_target" in err.child_traceback
    assert_nothing_left()


def test_actor_process_dying_in_init_fails_the_launch_naming_the_rank(cluster):
    with pytest.raises(RankLaunchError) as info:
        run_ranks_ray(cpu_args(tp_size=1), target=ray_helpers.dying_target, timeout_s=TIMEOUT_S,
                      planner=ray_helpers.hand_planner)
    assert info.value.label == "DP0 PP0 TP0"
    assert "died before it was ready" in str(info.value)
    assert_nothing_left()


def test_a_launch_that_does_not_fit_the_cluster_fails_at_its_deadline_and_leaves_no_group(cluster):
    # Three CPU ranks need three CPUs; the cluster has two.
    with pytest.raises(RankLaunchError) as info:
        run_ranks_ray(cpu_args(tp_size=3), target=ray_helpers.reporting_target, timeout_s=2.0,
                      planner=ray_helpers.hand_planner)
    assert "placement group for 3 rank(s)" in str(info.value)
    assert "was not reserved within 2 s" in str(info.value)
    groups = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in groups.values())


def test_a_node_that_cannot_plan_fails_the_launch_naming_its_ranks_and_leaves_nothing(cluster):
    with pytest.raises(RankLaunchError) as info:
        run_ranks_ray(cpu_args(), target=ray_helpers.reporting_target, timeout_s=TIMEOUT_S,
                      planner=ray_helpers.failing_planner)
    assert str(info.value).startswith("DP0 PP0 TP0, DP0 PP0 TP1: placement could not be resolved on its node: ")
    assert "ValueError: no plan on this node" in str(info.value)
    assert_nothing_left()
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_a_node_that_plans_past_the_deadline_fails_in_time_and_its_task_is_cancelled(cluster):
    started = time.monotonic()
    with pytest.raises(RankLaunchError) as info:
        run_ranks_ray(cpu_args(), target=ray_helpers.reporting_target, timeout_s=3.0,
                      planner=ray_helpers.sleeping_planner)
    assert time.monotonic() - started < 3.0 + SHUTDOWN_WAIT_S
    assert str(info.value).startswith("DP0 PP0 TP0, DP0 PP0 TP1: placement not resolved on its node within 3 s. ")
    assert_nothing_left()
    # The planning task was cancelled (its worker killed) rather than left sleeping on the node. (On a host
    # too loaded to start it within the deadline it never ran, and its cancellation kept it from running.)
    pid_file = ray_helpers.sleeping_pid_file(ray.get_runtime_context().get_node_id())
    if not os.path.exists(pid_file):
        return
    with open(pid_file, encoding="ascii") as f:
        pid = int(f.read())
    os.unlink(pid_file)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"the planning task's worker {pid} is still running"
        time.sleep(0.1)
