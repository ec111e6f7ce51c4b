"""The Ray launcher's pure decisions: the py_executable string Ray hands to a shell, the start strategy of a
rank's plan (one or several candidate ids), the placement an actor picks, and what the driver forwards."""

from __future__ import annotations

import pytest

from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.scheduler_launch.ray_launcher import (
    accelerator_resource,
    engine_ranks,
    forwarded_env,
    rank_bundle,
    rank_resources,
)
from sglang.srt.scheduler_rank.ray_plan import (
    BundleSite,
    Candidate,
    RankPlan,
    actor_placement,
    by_node,
    exec_argv_problem,
    py_executable,
    ranks_on_sites,
    start_decision,
    unplaced_start,
)
from sglang.srt.placement.engine_args import EngineArgs

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


def one(placement, *, exec_argv=None, exec_problem=None, accelerator_id=None) -> RankPlan:
    return RankPlan(rank=RANK, bundle_index=1, candidates=(
        Candidate(accelerator_id=accelerator_id, placement=placement,
                  exec_argv=tuple(exec_argv) if exec_argv is not None else None, exec_problem=exec_problem),))


def decide(plan: RankPlan, *, force_in_process=False, resource="CPU"):
    start, command = start_decision(plan, accelerator_resource=resource, node_id="node-a",
                                    force_in_process=force_in_process, log=lambda _: None)
    assert start.rank == RANK and start.node_id == "node-a" and start.accelerator_resource == resource
    return start, command


def test_exec_start_keeps_the_nodes_placement_and_builds_the_command():
    placement = exec_placement()
    start, command = decide(one(placement, exec_argv=[NUMACTL, *placement.numactl_args, PYTHON]))
    assert start.candidates == ((None, placement),)
    assert command == f"{NUMACTL} --physcpubind=1 --membind=0 {PYTHON}"


def test_a_python_path_with_a_space_binds_in_process_and_says_why():
    placement = exec_placement()
    start, command = decide(one(placement, exec_argv=[NUMACTL, *placement.numactl_args, "/opt/my env/bin/python"]))
    ((_, got),) = start.candidates
    assert command is None
    assert got.strategy == "in-process" and got.numactl_args == ()
    assert got.cpus == placement.cpus and got.mem_nodes == placement.mem_nodes and got.mem_policy == "bind"
    assert got.reasons[0] == "planned"
    assert "'/opt/my env/bin/python'" in got.reasons[-1] and got.reasons[-1].endswith("in-process bind with libnuma")


def test_a_problem_found_on_the_node_binds_in_process_and_says_why():
    start, command = decide(one(exec_placement(), exec_problem="numactl --membind=7 does not start on this node: "
                                                              "node argument 7 is out of range"))
    ((_, got),) = start.candidates
    assert command is None and got.strategy == "in-process"
    assert "node argument 7 is out of range" in got.reasons[-1]


def test_forcing_in_process_overrides_an_exec_placement():
    placement = exec_placement()
    start, command = decide(one(placement, exec_argv=[NUMACTL, *placement.numactl_args, PYTHON]),
                            force_in_process=True)
    ((_, got),) = start.candidates
    assert command is None and got.strategy == "in-process"
    assert got.reasons[-1] == "the launcher was asked to bind in-process: in-process bind with libnuma"


def test_non_exec_placements_pass_through():
    placement = exec_placement().replace(strategy="none", numactl_args=(), mem_policy="none", cpus=frozenset(),
                                         mem_nodes=frozenset())
    start, command = decide(one(placement))
    assert start.candidates == ((None, placement),) and command is None


def gpu_candidate(gpu: str, pci: str, cpus, args) -> Candidate:
    placement = exec_placement(args).replace(pci=pci, cpus=frozenset(cpus), reasons=(f"GPU {gpu}",))
    return Candidate(accelerator_id=gpu, placement=placement, exec_argv=(NUMACTL, *args, PYTHON))


def test_candidates_that_bind_alike_start_under_one_command_and_keep_their_own_device():
    plan = RankPlan(rank=RANK, bundle_index=0, candidates=(
        gpu_candidate("0", "0000:18:00.0", {0, 1}, ("--cpunodebind=0", "--membind=0")),
        gpu_candidate("1", "0000:28:00.0", {0, 1}, ("--cpunodebind=0", "--membind=0")),
    ))
    assert plan.agreed
    start, command = decide(plan, resource="GPU")
    assert command == f"{NUMACTL} --cpunodebind=0 --membind=0 {PYTHON}"
    assert [(i, p.pci, p.strategy) for i, p in start.candidates] == [("0", "0000:18:00.0", "exec"),
                                                                      ("1", "0000:28:00.0", "exec")]
    # The actor takes the placement of the GPU Ray gave it.
    placement, premises = actor_placement(start, ["1"], node_id="node-a")
    assert placement.pci == "0000:28:00.0" and premises == []


def test_candidates_that_bind_differently_bind_in_process_once_the_actor_knows_its_id():
    plan = RankPlan(rank=RANK, bundle_index=0, candidates=(
        gpu_candidate("0", "0000:18:00.0", {0}, ("--physcpubind=0", "--membind=0")),
        gpu_candidate("1", "0000:28:00.0", {1}, ("--physcpubind=1", "--membind=0")),
    ))
    assert not plan.agreed
    start, command = decide(plan, resource="GPU")
    assert command is None
    assert all(p.strategy == "in-process" and p.numactl_args == () for _, p in start.candidates)
    assert "GPU ids 0, 1 that Ray may give this rank bind differently" in start.candidates[0][1].reasons[-1]
    placement, premises = actor_placement(start, ["1"], node_id="node-a")
    assert placement.cpus == frozenset({1}) and premises == []


def test_an_actor_on_another_node_or_device_than_planned_reports_both_premises():
    plan = RankPlan(rank=RANK, bundle_index=0, candidates=(
        gpu_candidate("0", "0000:18:00.0", {0}, ("--physcpubind=0", "--membind=0")),))
    start, _ = decide(plan, resource="GPU")
    placement, premises = actor_placement(start, ["3"], node_id="node-b")
    assert placement.pci == "0000:18:00.0"
    assert premises == ["placement resolved on Ray node node-a, actor runs on node node-b",
                        "placement resolved for GPU ['0'], Ray gave this actor ['3']"]


def test_an_unplaced_actor_applies_nothing():
    start = unplaced_start(RANK, accelerator_resource="GPU")
    assert not start.placed and start.candidates == ()
    assert actor_placement(start, ["0"], node_id="node-a") == (None, [])


def test_ranks_take_their_bundles_ids_and_group_by_node():
    sites = {0: BundleSite(0, "node-a", "10.0.0.1", ("0", "1")), 1: BundleSite(1, "node-b", "10.0.0.2", ("2",)),
             2: BundleSite(2, "node-a", "10.0.0.1", ("3",))}
    ranks = [RankIdentity(0, 0, t, gpu_id=t % 2, global_rank=t) for t in range(4)]
    pairs = [(ranks[0], 0), (ranks[1], 0), (ranks[2], 1), (ranks[3], 2)]
    assert [r.accelerator_ids for r in ranks_on_sites(pairs, sites)] == [("0", "1"), ("0", "1"), ("2",), ("3",)]
    grouped = by_node(pairs, {index: site.node_id for index, site in sites.items()})
    assert {node: [(r.tp_rank, index) for r, index in members] for node, members in grouped.items()} == {
        "node-a": [(0, 0), (1, 0), (3, 2)], "node-b": [(2, 1)]}


def test_engine_ranks_span_every_node_rank():
    ranks = engine_ranks(EngineArgs(tp_size=4, nnodes=2, node_rank=1))
    assert [(r.tp_rank, r.gpu_id) for r in ranks] == [(0, 0), (1, 1), (2, 0), (3, 1)]


def test_only_the_placement_settings_set_on_the_driver_are_forwarded():
    environ = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
               "SGLANG_UNRELATED": "x", "PATH": "/bin"}
    assert forwarded_env(environ) == {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"}


def test_the_drivers_sysfs_root_is_not_forwarded_each_node_keeps_its_own():
    environ = {"SGLANG_SYSFS_ROOT": "/driver/only/sys", "SGLANG_NUMA_AFFINITY_MODE": "exclusive"}
    assert forwarded_env(environ) == {"SGLANG_NUMA_AFFINITY_MODE": "exclusive"}


@pytest.mark.parametrize("device, resource", [("cpu", "CPU"), ("cuda", "GPU"), ("xpu", "GPU")])
def test_each_rank_holds_one_cpu_or_one_accelerator(device, resource):
    assert accelerator_resource(device) == resource
    assert rank_bundle(device) == {resource: 1.0}
    held = rank_resources(device)
    assert held == ({"num_cpus": 1, "num_gpus": 0} if resource == "CPU" else {"num_cpus": 0, "num_gpus": 1})


def test_a_thread_left_on_other_cpus_is_reported_even_when_the_main_thread_is_bound():
    import os
    import threading

    from sglang.srt.scheduler_rank.common import thread_mismatches

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
