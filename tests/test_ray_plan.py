"""The Ray path's pure decisions: the py_executable string Ray hands to a shell, what a rank's actor starts with
(one or several candidate ids), the candidate an actor takes, and what the driver forwards to it."""

from __future__ import annotations

import os
import threading

import pytest

from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.types import ProcessPlacement, RankIdentity
from sglang.srt.scheduler_placement.ray_actors import forwarded_env
from sglang.srt.scheduler_placement.ray_plan import (
    ActorStart,
    Candidate,
    actor_choice,
    py_executable,
    start_for_rank,
)
from sglang.srt.scheduler_placement.ray_rank import thread_mismatches

NUMACTL = "/usr/bin/numactl"
PYTHON = "/work/main/.venv/bin/python3.11"
RANK = RankIdentity(dp_rank=1, pp_rank=0, tp_rank=1, gpu_id=0)
POLICY = PlacementPolicy(launcher="ray", device="cuda")


def placement(
    gpu: int = 0, cpus=(1,), args=("--physcpubind=1", "--membind=0"), **changes
) -> ProcessPlacement:
    return ProcessPlacement(
        rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=gpu), pci=f"0000:{0x18 + 16 * gpu:02x}:00.0",
        numa_node=0, cpus=frozenset(cpus), mem_nodes=frozenset({0}), mem_policy="bind",
        strategy="exec", reasons=(f"GPU {gpu}",), numactl_args=tuple(args), launcher="ray",
    ).replace(**changes)  # fmt: skip


def candidate(gpu: int, *, python: str = PYTHON, **changes) -> Candidate:
    p = placement(gpu, **changes)
    return Candidate(
        accelerator_id=str(gpu),
        placement=p,
        exec_argv=(NUMACTL, *p.numactl_args, python),
    )


def decide(*candidates: Candidate) -> tuple[ActorStart, str | None]:
    return start_for_rank(candidates, rank=RANK, policy=POLICY, node_id="node-a")


# ----------------------------------------------------------------------------- py_executable


def test_a_numactl_command_becomes_the_plain_string_ray_expects():
    argv = [NUMACTL, "--cpunodebind=0-1", "--membind=0,1", "--preferred=3", PYTHON]
    assert py_executable(argv) == (
        f"{NUMACTL} --cpunodebind=0-1 --membind=0,1 --preferred=3 {PYTHON}"
    )


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
    with pytest.raises(ValueError) as info:
        py_executable(argv)
    assert repr(named) in str(info.value)


# ----------------------------------------------------------------------------- the start decision


def test_one_exec_candidate_starts_under_numactl_as_the_rank_it_is_for():
    start, command = decide(candidate(3))
    assert command == f"{NUMACTL} --physcpubind=1 --membind=0 {PYTHON}"
    ((only),) = start.candidates
    # Told which rank it is for; its GPU id stays the device's (Ray's id), not the one RayEngine passed.
    got = only.placement
    assert (got.rank.dp_rank, got.rank.tp_rank, got.rank.gpu_id, got.strategy) == (1, 1, 3, "exec")
    assert start.enforced and start.node_id == "node-a" and start.policy is POLICY


def test_candidates_that_bind_alike_start_under_one_command_and_keep_their_own_device():
    start, command = decide(candidate(0), candidate(1))
    assert command == f"{NUMACTL} --physcpubind=1 --membind=0 {PYTHON}"
    assert [(c.accelerator_id, c.placement.pci) for c in start.candidates] == [
        ("0", "0000:18:00.0"),
        ("1", "0000:28:00.0"),
    ]
    assert not start.enforced  # which one applies is known only in the actor
    chosen, why = actor_choice(start, ["1"], node_id="node-a")
    assert chosen.placement.pci == "0000:28:00.0" and why == ""


def test_candidates_that_bind_differently_bind_in_process_by_design_not_as_a_failure():
    start, command = decide(
        candidate(0, cpus=(0,), args=("--physcpubind=0", "--membind=0")),
        candidate(1, cpus=(1,), args=("--physcpubind=1", "--membind=0")),
    )
    assert command is None
    for c in start.candidates:
        assert c.placement.strategy == "in-process" and c.placement.numactl_args == ()
        assert not c.placement.warning
    assert "GPU ids 0, 1 that Ray may give this rank bind differently" in (
        start.candidates[0].placement.reasons[-1]
    )
    chosen, _ = actor_choice(start, ["1"], node_id="node-a")
    assert chosen.placement.cpus == frozenset({1})


def test_a_command_the_shell_would_mangle_binds_in_process_as_a_failure():
    start, command = decide(candidate(0, python="/opt/my env/bin/python"))
    ((only),) = start.candidates
    assert command is None
    got = only.placement
    assert got.strategy == "in-process" and got.warning
    assert got.cpus == frozenset({1}) and got.mem_policy == "bind"
    assert "'/opt/my env/bin/python'" in got.reasons[-1]
    assert got.reasons[-1].endswith("in-process bind with libnuma")


def test_numactl_refusing_on_the_node_binds_in_process_as_a_failure():
    refused = Candidate(
        accelerator_id="0", placement=placement(0), exec_problem="numactl refused"
    )
    start, command = decide(refused)
    assert command is None
    assert start.candidates[0].placement.warning
    assert "numactl refused" in start.candidates[0].placement.reasons[-1]


def test_non_exec_placements_pass_through():
    unbound = placement(0, strategy="none", numactl_args=(), mem_policy="none", cpus=())
    start, command = decide(Candidate(accelerator_id="0", placement=unbound))
    assert command is None and start.candidates[0].placement.strategy == "none"


def test_a_candidate_with_an_error_does_not_agree_with_the_others():
    error = Candidate(
        accelerator_id="1", placement=None, error="--numa-node has 1 entry"
    )
    assert decide(error) == (ActorStart(POLICY, "node-a", (error,)), None)
    start, command = decide(candidate(0), error)
    assert command is None and start.candidates[0].placement.strategy == "in-process"
    chosen, _ = actor_choice(start, ["1"], node_id="node-a")
    assert chosen.error == "--numa-node has 1 entry"


# ----------------------------------------------------------------------------- the actor's choice


def test_an_actor_on_another_node_or_gpu_than_planned_places_itself_and_says_why():
    start, _ = decide(candidate(0))
    assert actor_choice(start, ["0"], node_id="node-b") == (
        None,
        "its bundle was planned on Ray node node-a, but the actor runs on node node-b",
    )
    assert actor_choice(start, ["3"], node_id="node-a") == (
        None,
        "its bundle was planned for GPU ids ['0'], but Ray gave the actor '3'",
    )
    unplanned = ActorStart(policy=POLICY, unplanned="no plan: timeout")
    assert actor_choice(unplanned, ["0"], node_id="node-a") == (
        None,
        "no plan: timeout",
    )


def test_a_bundle_placement_for_a_rank_keeps_its_device_or_takes_the_ranks_id():
    (own,) = decide(candidate(2))[0].candidates
    assert own.placement.rank.gpu_id == 2
    no_device = Candidate(
        accelerator_id="2", placement=placement(2).replace(
            rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=None)
        ),
    )
    assert decide(no_device)[0].candidates[0].placement.rank.gpu_id == RANK.gpu_id


# ----------------------------------------------------------------------------- what the driver forwards


def test_only_the_engines_placement_settings_set_on_the_driver_are_forwarded():
    environ = {
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
        "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
        "SGLANG_UNRELATED": "x",
        "PATH": "/bin",
        "SGLANG_SYSFS_ROOT": "/driver/only/sys",  # each node keeps its own
    }
    assert forwarded_env(environ) == {
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
        "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
    }


# ----------------------------------------------------------------------------- the read-back of every thread


def test_a_thread_left_on_other_cpus_is_reported_even_when_the_main_thread_is_bound():
    everything = frozenset(os.sched_getaffinity(0))
    if len(everything) < 2:
        pytest.fail("this check needs a process allowed on at least two CPUs")
    one = min(everything)
    bound = placement(cpus=everything, strategy="in-process", numactl_args=())
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
        (line,) = thread_mismatches(bound)
        assert (
            line.startswith("1 of ")
            and f"(thread {tid[0]}: cpus {one}, planned " in line
        )
        assert thread_mismatches(bound.replace(strategy="none")) == []
    finally:
        stop.set()
        worker.join()
    assert thread_mismatches(bound) == []
