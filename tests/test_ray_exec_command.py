"""The Ray launcher's pure decisions: the py_executable string Ray hands to a shell, and the start strategy."""

from __future__ import annotations

import pytest

from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.scheduler_launch.ray_launcher import (
    accelerator_resource,
    exec_argv_problem,
    forwarded_env,
    py_executable,
    rank_bundle,
    rank_resources,
    start_decision,
)

NUMACTL = "/usr/bin/numactl"
PYTHON = "/work/main/.venv/bin/python3.11"
RANK = RankIdentity(dp_rank=0, pp_rank=0, tp_rank=1, gpu_id=None, global_rank=1)


def exec_placement(args=("--physcpubind=1", "--membind=0")) -> ProcessPlacement:
    return ProcessPlacement(
        dp_rank=0, pp_rank=0, tp_rank=1, gpu_id=None, pci=None, numa_node=0, cpus=frozenset({1}),
        mem_nodes=frozenset({0}), mem_policy="bind", strategy="exec", reasons=("planned",),
        numactl_args=tuple(args), launcher="ray",
    )


def test_a_numactl_command_becomes_the_plain_string_ray_expects():
    argv = [NUMACTL, "--cpunodebind=0-1", "--membind=0,1", "--preferred=3", PYTHON]
    assert exec_argv_problem(argv) is None
    assert py_executable(argv) == f"{NUMACTL} --cpunodebind=0-1 --membind=0,1 --preferred=3 {PYTHON}"


@pytest.mark.parametrize(
    "argv, named",
    [
        ([NUMACTL, "--membind=0", "/opt/my env/bin/python"], "/opt/my env/bin/python"),
        ([NUMACTL, "--membind=0", "python3"], "python3"),
        ([NUMACTL, "--membind=0", PYTHON + ";id"], PYTHON + ";id"),
        ([NUMACTL, "--membind=0", "/usr/bin/$(id)"], "/usr/bin/$(id)"),
        ([NUMACTL, "--membind=0", "/usr/bin/`id`"], "/usr/bin/`id`"),
        ([NUMACTL, "--membind=0", "/usr/bin/py\nid"], "/usr/bin/py\nid"),
        ([NUMACTL, "--membind=0 && id", PYTHON], "--membind=0 && id"),
        ([NUMACTL, "--membind=0|id", PYTHON], "--membind=0|id"),
        ([NUMACTL, "--physcpubind=$CPUS", PYTHON], "--physcpubind=$CPUS"),
        ([NUMACTL, "-m0", PYTHON], "-m0"),
        (["numactl", "--membind=0", PYTHON], "numactl"),
        ([NUMACTL + " ", "--membind=0", PYTHON], NUMACTL + " "),
    ],
)
def test_a_token_the_shell_would_split_or_expand_is_refused_and_named(argv, named):
    problem = exec_argv_problem(argv)
    assert problem is not None and repr(named) in problem
    with pytest.raises(ValueError):
        py_executable(argv)


def test_exec_start_keeps_the_nodes_placement_and_builds_the_command():
    placement = exec_placement()
    resolved = {"placement_json": placement.to_json(), "exec_argv": [NUMACTL, *placement.numactl_args, PYTHON],
                "exec_problem": None}
    got, command = start_decision(rank=RANK, resolved=resolved, force_in_process=False)
    assert got == placement
    assert command == f"{NUMACTL} --physcpubind=1 --membind=0 {PYTHON}"


def test_a_python_path_with_a_space_binds_in_process_and_says_why():
    placement = exec_placement()
    resolved = {"placement_json": placement.to_json(), "exec_argv": [NUMACTL, *placement.numactl_args,
                                                                      "/opt/my env/bin/python"],
                "exec_problem": None}
    got, command = start_decision(rank=RANK, resolved=resolved, force_in_process=False)
    assert command is None
    assert got.strategy == "in-process" and got.numactl_args == ()
    assert got.cpus == placement.cpus and got.mem_nodes == placement.mem_nodes and got.mem_policy == "bind"
    assert got.reasons[0] == "planned"
    assert "'/opt/my env/bin/python'" in got.reasons[-1] and got.reasons[-1].endswith("in-process bind with libnuma")


def test_a_problem_found_on_the_node_binds_in_process_and_says_why():
    placement = exec_placement()
    resolved = {"placement_json": placement.to_json(), "exec_argv": None,
                "exec_problem": "numactl --membind=7 does not start on this node: node argument 7 is out of range"}
    got, command = start_decision(rank=RANK, resolved=resolved, force_in_process=False)
    assert command is None and got.strategy == "in-process"
    assert "node argument 7 is out of range" in got.reasons[-1]


def test_forcing_in_process_overrides_an_exec_placement():
    placement = exec_placement()
    resolved = {"placement_json": placement.to_json(), "exec_argv": [NUMACTL, *placement.numactl_args, PYTHON],
                "exec_problem": None}
    got, command = start_decision(rank=RANK, resolved=resolved, force_in_process=True)
    assert command is None and got.strategy == "in-process"
    assert got.reasons[-1] == "the launcher was asked to bind in-process: in-process bind with libnuma"


def test_non_exec_placements_pass_through():
    placement = exec_placement().replace(strategy="none", numactl_args=(), mem_policy="none", cpus=frozenset(),
                                         mem_nodes=frozenset())
    got, command = start_decision(rank=RANK, resolved={"placement_json": placement.to_json()}, force_in_process=False)
    assert got == placement and command is None


def test_only_the_placement_settings_set_on_the_driver_are_forwarded():
    environ = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
               "SGLANG_UNRELATED": "x", "PATH": "/bin"}
    assert forwarded_env(environ) == {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"}


@pytest.mark.parametrize("device, resource", [("cpu", "CPU"), ("cuda", "GPU"), ("xpu", "GPU")])
def test_each_rank_holds_one_cpu_or_one_accelerator(device, resource):
    assert accelerator_resource(device) == resource
    assert rank_bundle(device) == {resource: 1.0}
    held = rank_resources(device)
    assert held == ({"num_cpus": 1, "num_gpus": 0} if resource == "CPU" else {"num_cpus": 0, "num_gpus": 1})


def test_a_thread_left_on_other_cpus_is_reported_even_when_the_main_thread_is_bound():
    import os
    import threading

    from sglang.srt.scheduler_launch.common import thread_mismatches

    everything = frozenset(os.sched_getaffinity(0))
    if len(everything) < 2:
        pytest.fail("this check needs a process allowed on at least two CPUs")
    one = min(everything)
    placement = exec_placement().replace(cpus=everything, strategy="in-process", numactl_args=())
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def narrowed() -> None:
        os.sched_setaffinity(0, {one})  # 0 is the calling thread
        tid.append(threading.get_native_id())
        started.set()
        stop.wait()

    worker = threading.Thread(target=narrowed)
    worker.start()
    try:
        started.wait()
        (line,) = thread_mismatches(placement)
        assert line.startswith("1 of ") and f"(thread {tid[0]}: cpus {one}, planned " in line
        assert thread_mismatches(placement.replace(strategy="none")) == []
    finally:
        stop.set()
        worker.join()
    assert thread_mismatches(placement) == []
