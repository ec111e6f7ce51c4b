"""The in-process strategy: every thread's CPUs, the memory policy ladder, page migration.

CPU affinity calls are real (on CPUs this host has); the multi-node memory side
uses the libnuma fake, and the real libnuma runs in a child process.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import unittest.mock

import pytest
from fakelibnuma import FakeLibNuma

from sglang.srt.environ import envs
from sglang.srt.placement import apply as apply_mod
from sglang.srt.placement.libnuma import MPOL_BIND, MPOL_PREFERRED
from sglang.srt.placement.apply import (
    BindOutcome,
    bind_in_process,
    set_all_threads_affinity,
)
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    NumaNode,
    PlacementError,
    ProcessPlacement,
    RankIdentity,
)

HOST_CPUS = sorted(os.sched_getaffinity(0))
TARGET_CPUS = frozenset({HOST_CPUS[-1]})


def placement(**changes) -> ProcessPlacement:
    fields = dict(
        rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=1),
        pci=None,
        numa_node=1,
        cpus=TARGET_CPUS,
        mem_nodes=frozenset({1}),
        mem_policy="bind",
        strategy="in-process",
        reasons=("node 1 from test",),
    )
    fields.update(changes)
    return ProcessPlacement(**fields)


def two_node_fake(**kwargs) -> FakeLibNuma:
    return FakeLibNuma(node_cpus={0: (HOST_CPUS[0],), 1: (HOST_CPUS[-1],)}, **kwargs)


@pytest.fixture(autouse=True)
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), before)
        except ProcessLookupError:
            pass


@pytest.fixture
def no_libnuma(monkeypatch):
    monkeypatch.setattr(apply_mod, "load_libnuma", lambda: None)


def bind_with(p: ProcessPlacement, lib: FakeLibNuma):
    """bind_in_process with ``lib`` as the libnuma placement loads."""
    with unittest.mock.patch.object(apply_mod, "load_libnuma", return_value=lib):
        return bind_in_process(p)


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """A /proc/self/task of made-up thread ids, and a recording sched_setaffinity."""
    monkeypatch.setattr(apply_mod, "TASKS_DIR", str(tmp_path))
    calls: list[int] = []
    actions: dict[int, object] = {}

    def setaffinity(tid, cpus):
        calls.append(tid)
        if tid in actions:
            actions[tid]()

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    return tmp_path, calls, actions


def test_binds_every_thread_sets_membind_and_migrates():
    fake = two_node_fake(pages={0: 500, 1: 20}, unmovable_pages=7)
    started = threading.Event()
    release = threading.Event()
    tids: list[int] = []

    def worker():
        tids.append(threading.get_native_id())
        started.set()
        release.wait(30)

    workers = [threading.Thread(target=worker) for _ in range(2)]
    for t in workers:
        started.clear()
        t.start()
        started.wait(30)
    try:
        outcome = bind_with(placement(), fake)
        for tid in tids + [threading.get_native_id()]:
            assert os.sched_getaffinity(tid) == TARGET_CPUS
    finally:
        release.set()
        for t in workers:
            t.join()

    assert outcome.cpus == TARGET_CPUS
    assert outcome.threads >= 3
    assert (outcome.mem_policy, outcome.mem_nodes) == ("bind", {1})
    assert (fake.policy, fake.policy_nodes) == ("bind", {1})
    assert fake.called("move_private_pages") == [(MPOL_BIND, frozenset({1}))]
    assert outcome.mappings_not_moved == 7
    assert fake.pages == {0: 7, 1: 513}
    assert not outcome.notes
    assert outcome.summary.startswith("DP0 PP0 TP1: ")
    assert (
        "bind on node(s) 1" in outcome.summary
        and "7 mapping(s) not moved" in outcome.summary
    )


def test_membind_rejected_degrades_to_preferred_and_says_so():
    fake = two_node_fake(fail={"set_membind": errno.EPERM})
    outcome = bind_with(placement(), fake)
    assert (outcome.mem_policy, outcome.mem_nodes) == ("preferred", {1})
    assert (fake.policy, fake.policy_nodes) == ("preferred", {1})
    assert outcome.notes
    assert "membind to node 1 rejected" in outcome.notes[0]
    assert "falling back to preferred node 1" in outcome.notes[0]
    assert fake.called("move_private_pages") == [(MPOL_PREFERRED, frozenset({1}))]
    assert outcome.cpus == TARGET_CPUS


def test_node_without_memory_ends_cpu_only_like_the_kernel():
    fake = two_node_fake(memory_nodes={0})
    outcome = bind_with(placement(), fake)
    assert outcome.mem_policy == "none"
    assert outcome.cpus == TARGET_CPUS
    assert len(outcome.notes) == 2 and "CPU binding only" in outcome.notes[1]
    assert fake.called("move_private_pages") == []
    assert fake.policy == "default"


def test_preferred_placement_sets_preferred_on_the_rank_node():
    fake = two_node_fake()
    outcome = bind_with(placement(mem_policy="preferred"), fake)
    assert fake.called("set_membind") == []
    assert fake.called("set_preferred") == [(1,)]
    assert (outcome.mem_policy, outcome.mem_nodes) == ("preferred", {1})


def test_mem_policy_none_leaves_memory_alone():
    fake = two_node_fake()
    outcome = bind_with(placement(mem_policy="none", mem_nodes=frozenset()), fake)
    assert fake.calls == []
    assert outcome.cpus == TARGET_CPUS and outcome.mem_policy == "none"
    assert outcome.mappings_not_moved is None and not outcome.notes


def test_strategy_none_binds_nothing():
    fake = two_node_fake()
    before = os.sched_getaffinity(0)
    outcome = bind_with(placement(strategy="none", reasons=("single NUMA node",)), fake)
    assert fake.calls == []
    assert os.sched_getaffinity(0) == before
    assert outcome.cpus == frozenset() and "single NUMA node" in outcome.summary


def test_missing_libnuma_still_binds_cpus(no_libnuma, caplog):
    with caplog.at_level(logging.WARNING, logger=apply_mod.__name__):
        outcome = bind_in_process(placement())
    assert outcome.cpus == TARGET_CPUS
    assert os.sched_getaffinity(0) == TARGET_CPUS
    assert outcome.mem_policy == "none" and outcome.mappings_not_moved is None
    assert "libnuma.so.1 is not available" in outcome.notes[0]
    assert any(
        "DP0 PP0 TP1" in r.getMessage() and "libnuma" in r.getMessage()
        for r in caplog.records
    )


def test_crash_flag_turns_missing_libnuma_into_placement_error(no_libnuma):
    before = os.sched_getaffinity(0)
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True):
        with pytest.raises(PlacementError) as info:
            bind_in_process(placement())
    message = str(info.value)
    assert "DP0 PP0 TP1" in message
    assert "libnuma.so.1 is not available" in message
    assert "SGLANG_CRASH_ON_NUMA_BIND_FAILURE" in message
    assert os.sched_getaffinity(0) == before


def test_crash_flag_turns_rejected_membind_into_placement_error():
    fake = two_node_fake(fail={"set_membind": errno.EINVAL})
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True):
        with pytest.raises(
            PlacementError, match=r"DP0 PP0 TP1: membind to node 1 rejected"
        ):
            bind_with(placement(), fake)
    assert fake.called("set_preferred") == []


def test_threads_that_exit_during_the_walk_are_skipped(tasks):
    root, seen, actions = tasks
    for tid in ("101", "102", "103"):
        (root / tid).mkdir()

    def gone():
        raise ProcessLookupError(errno.ESRCH, "No such process")

    actions[102] = gone
    outcome = bind_with(placement(mem_policy="none"), two_node_fake())
    assert seen == [101, 102, 103]
    assert outcome.threads == 2 and outcome.cpus == TARGET_CPUS and not outcome.notes


def test_threads_started_during_the_walk_are_bound_too(tasks):
    root, seen, actions = tasks
    (root / "1").mkdir()
    actions[1] = lambda: (root / "2").mkdir()
    outcome = bind_with(placement(mem_policy="none"), two_node_fake())
    assert seen == [1, 2] and outcome.threads == 2


def test_set_all_threads_affinity_moves_every_real_thread():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        moved, refusal = set_all_threads_affinity(TARGET_CPUS)
        assert moved >= 2 and refusal is None
        assert os.sched_getaffinity(worker.native_id) == TARGET_CPUS
        assert os.sched_getaffinity(0) == TARGET_CPUS
    finally:
        stop.set()
        worker.join()


def test_set_all_threads_affinity_refusal_names_the_thread_and_the_count(tasks):
    root, _, actions = tasks
    for tid in ("1", "2", "3"):
        (root / tid).mkdir()

    def refuse():
        raise OSError(errno.EINVAL, "Invalid argument")

    actions[2] = refuse
    assert set_all_threads_affinity(TARGET_CPUS) == (1, "thread 2: Invalid argument")


def test_cpus_the_kernel_refuses_are_reported():
    fake = two_node_fake()
    before = os.sched_getaffinity(0)
    outcome = bind_with(placement(cpus=frozenset({8191})), fake)
    assert outcome.cpus == frozenset()
    assert "cpu affinity 8191 not applied" in outcome.notes[0]
    assert os.sched_getaffinity(0) == before
    assert outcome.mem_policy == "bind"


def test_outcome_is_frozen():
    outcome = bind_with(placement(mem_policy="none"), two_node_fake())
    assert isinstance(outcome, BindOutcome)
    with pytest.raises(AttributeError):
        outcome.threads = 0


def test_real_libnuma_bind_in_a_child_matches_its_placement():
    """End to end on this host's real kernel: bind node 0 in process, read it back, compare."""
    cpu = HOST_CPUS[0]
    code = f"""
        import json, threading
        from sglang.srt.placement.apply import bind_in_process
        from sglang.srt.placement_tools.verify import compare_binding, observe_self
        from sglang.srt.placement.types import ProcessPlacement, RankIdentity
        p = ProcessPlacement(rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0), pci=None, numa_node=0,
                             cpus=frozenset({{{cpu}}}), mem_nodes=frozenset({{0}}), mem_policy="bind",
                             strategy="in-process", reasons=())
        stop = threading.Event()
        t = threading.Thread(target=stop.wait); t.start()
        outcome = bind_in_process(p)
        import os
        thread_cpus = sorted(os.sched_getaffinity(t.native_id))
        stop.set(); t.join()
        observed = observe_self()
        print(json.dumps({{"summary": outcome.summary, "policy": outcome.mem_policy,
                          "not_moved": outcome.mappings_not_moved, "thread_cpus": thread_cpus,
                          "diffs": compare_binding(p, observed), "observed": observed.to_dict()}}))
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["policy"] == "bind"
    assert out["not_moved"] == 0
    assert out["thread_cpus"] == [cpu]
    assert out["diffs"] == [], out
    assert (
        out["observed"]["policy"] == "bind" and out["observed"]["policy_nodes"] == "0"
    )
