"""Upstream's numa_utils names on the placement core, with real spawn and numactl."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.spawn
import os
import sys
from typing import Iterator

import fakesys
import pytest
from conftest import setting
from fakelibnuma import FakeLibNuma
from spawn_support import args

from sglang.srt.placement import apply
from sglang.srt.placement.types import PlacementError
from sglang.srt.scheduler_placement import spawn
from sglang.srt.utils import numa_utils
from sglang.srt.utils.numa_utils import (
    configure_subprocess,
    get_libnuma,
    get_numa_node_if_available,
    init_threads_binding,
)


def armed_prefix():
    """The numactl prefix configure_subprocess armed for this thread's spawns."""
    use = spawn._state.use
    return None if use is None else use.prefix


ALL_CPUS = sorted(os.sched_getaffinity(0))
CPU_RANK = args(device="cpu", tp_size=2)
"""A CPU engine whose rank 1 starts under numactl --physcpubind=<last CPU> on this host."""


def report_cpus(writer) -> None:
    writer.send(sorted(os.sched_getaffinity(0)))
    writer.close()


def spawn_and_read_cpus(ctx_name: str = "spawn") -> list[int]:
    ctx = multiprocessing.get_context(ctx_name)
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=report_cpus, args=(writer,))
    proc.start()
    writer.close()
    try:
        return reader.recv()
    finally:
        proc.join(30)
        reader.close()


@pytest.fixture(autouse=True)
def _groups_and_nothing_left_armed(monkeypatch):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{ALL_CPUS[0]}|{ALL_CPUS[-1]}")
    yield
    assert armed_prefix() is None


# --------------------------------------------------------------------------- configure_subprocess


def test_configure_subprocess_arms_the_spawn_of_its_rank_only():
    with configure_subprocess(CPU_RANK, 1):
        assert armed_prefix()[1:] == (
            "--physcpubind=" + str(ALL_CPUS[-1]),
            "--membind=0",
        )
        assert spawn_and_read_cpus() == [ALL_CPUS[-1]]
    assert spawn_and_read_cpus() == ALL_CPUS


def test_configure_subprocess_restores_on_error():
    executable = multiprocessing.spawn.get_executable()
    with pytest.raises(KeyError):
        with configure_subprocess(CPU_RANK, 1):
            raise KeyError("start failed")
    assert multiprocessing.spawn.get_executable() == executable
    assert spawn_and_read_cpus() == ALL_CPUS


def test_configure_subprocess_warns_when_nothing_was_spawned(caplog):
    with caplog.at_level(logging.WARNING):
        with configure_subprocess(CPU_RANK, 1):
            assert spawn_and_read_cpus("fork") == ALL_CPUS
    assert (
        "CPU rank 1: no process was started with the spawn start method" in caplog.text
    )


def test_configure_subprocess_notices_a_changed_spawn_executable(caplog):
    original = multiprocessing.spawn.get_executable()
    try:
        with caplog.at_level(logging.WARNING):
            with configure_subprocess(CPU_RANK, 1):
                spawn_and_read_cpus()
                multiprocessing.set_executable(
                    os.path.realpath(sys.executable) + "-other"
                )
        assert "spawn executable changed" in caplog.text
        multiprocessing.set_executable(os.fsdecode(original))
        with setting("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", True), pytest.raises(
            PlacementError, match="changed"
        ):
            with configure_subprocess(CPU_RANK, 1):
                spawn_and_read_cpus()
                multiprocessing.set_executable(
                    os.path.realpath(sys.executable) + "-other"
                )
    finally:
        multiprocessing.set_executable(os.fsdecode(original))


def test_configure_subprocess_does_nothing_where_upstream_does_nothing(monkeypatch):
    # A GPU on this one-node host, and any rank with SGLANG_NUMA_BIND_V2=0.
    with configure_subprocess(args(tp_size=2), 0):
        assert armed_prefix() is None
    with setting("SGLANG_NUMA_BIND_V2", False), configure_subprocess(CPU_RANK, 1):
        assert armed_prefix() is None
    with configure_subprocess(args(device="npu"), 0):
        assert armed_prefix() is None


def test_a_device_sglang_does_not_place_reads_no_host_fact(monkeypatch):
    """As upstream, which returns before any sysfs read: a host without /sys (macOS
    with mps) or with an unreadable one starts its ranks unbound."""
    monkeypatch.setenv("SGLANG_SYSFS_ROOT", "/nonexistent")
    for device in ("mps", "npu"):
        with configure_subprocess(args(device=device), 0):
            assert armed_prefix() is None
    with setting("SGLANG_AUTO_NUMA_BIND", False):
        with configure_subprocess(args(tp_size=2), 0):
            assert armed_prefix() is None


# --------------------------------------------------------------------------- node, libnuma


def test_numa_node_from_the_explicit_list_first():
    assert get_numa_node_if_available(args(numa_node=[1, 0]), 1) == 0
    with setting("SGLANG_AUTO_NUMA_BIND", False):
        assert get_numa_node_if_available(args(numa_node=[1, 0]), 0) == 1
    with pytest.raises(ValueError, match="--numa-node has 2 entries but GPU 2"):
        get_numa_node_if_available(args(numa_node=[1, 0]), 2)


def test_numa_node_discovery_on_a_two_socket_host_answers_for_the_gpu_given(
    tmp_path, monkeypatch
):
    """GPU 2 of a two-socket host is on node 1, whichever rank asks; one GPU identified per call."""
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.setenv("SGLANG_SYSFS_ROOT", str(root))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(numa_utils, "_is_cuda", True)
    assert [get_numa_node_if_available(args(), gpu) for gpu in range(4)] == [0, 0, 1, 1]
    # Under a CUDA_VISIBLE_DEVICES that reorders the GPUs, logical GPU 0 is physical GPU 3.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")
    assert [get_numa_node_if_available(args(), gpu) for gpu in (0, 1)] == [1, 0]
    with setting("SGLANG_AUTO_NUMA_BIND", False):
        assert get_numa_node_if_available(args(), 0) is None


def test_numa_node_discovery_on_this_one_node_host_finds_nothing():
    assert get_numa_node_if_available(args(), 0) is None


def test_get_libnuma_returns_the_loaded_cdll_as_upstream():
    import ctypes

    lib = get_libnuma()
    assert isinstance(lib, ctypes.CDLL)
    assert lib.numa_available() >= 0


def test_numa_bind_to_node_without_libnuma_follows_the_failure_policy(
    monkeypatch, caplog
):
    monkeypatch.setattr(numa_utils, "get_libnuma", lambda: None)
    with caplog.at_level(logging.WARNING, logger=numa_utils.__name__):
        numa_utils.numa_bind_to_node(0)
    assert "numa not available on this system, skip bind action" in caplog.text
    with setting("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", True), pytest.raises(
        RuntimeError, match="numa not"
    ):
        numa_utils.numa_bind_to_node(0)


# --------------------------------------------------------------------------- init_threads_binding


def test_init_threads_binding_from_groups(caplog):
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "0|1"), caplog.at_level(
        logging.INFO, logger=numa_utils.__name__
    ):
        assert init_threads_binding(numa_index=1, world_size=2) == "1"
        # A router runs each DP worker as its own one-rank engine: the index still counts across the groups.
        assert init_threads_binding(numa_index=1, world_size=1) == "1"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert (
        lines[0]
        == "init_threads_binding: numa_index=1, world_size=2, local_omp_cpuid=1"
    )


def test_init_threads_binding_from_nodes():
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "all"):
        assert init_threads_binding(numa_index=0, world_size=1) == ",".join(
            map(str, ALL_CPUS)
        )
        with pytest.raises(ValueError, match="rank index 1 has none"):
            init_threads_binding(numa_index=1, world_size=2)


def test_init_threads_binding_counts_only_the_nodes_this_process_may_use(
    tmp_path, monkeypatch
):
    """Under `numactl --cpunodebind=1`, rank 0 of `all` gets node 1, as upstream's
    get_cpu_ids_by_node (which drops nodes without allowed CPUs) gives it."""
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.setenv("SGLANG_SYSFS_ROOT", str(root))
    from sglang.srt.placement import topology

    node1 = frozenset(range(8, 16)) | frozenset(range(24, 32))
    allowed = topology.ProcessAffinity(node1, frozenset({1}), "this process")
    monkeypatch.setattr(topology, "read_process_affinity", lambda: allowed)
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "all"):
        assert (
            init_threads_binding(numa_index=0, world_size=1) == "8,9,10,11,12,13,14,15"
        )
        with pytest.raises(
            ValueError, match=r"has 1 node\(s\) with CPUs this process may use"
        ):
            init_threads_binding(numa_index=1, world_size=2)


def test_init_threads_binding_rejects_bad_groups():
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "0|1"):
        with pytest.raises(ValueError, match="has 2 group"):
            init_threads_binding(numa_index=2, world_size=3)
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "0|x"):
        with pytest.raises(ValueError, match="not a cpulist"):
            init_threads_binding(numa_index=1, world_size=2)


# --------------------------------------------------------------------------- numa_bind_to_node (legacy V1)


class AvailableLibnuma:
    """What numa_bind_to_node asks of upstream's ``get_libnuma()`` CDLL."""

    def numa_available(self):
        return 0


@pytest.fixture
def legacy_host(tmp_path, monkeypatch):
    """Node 0 is this host's first CPU, node 1 all of its CPUs plus one only the tree has."""
    root = fakesys.write_sysfs(
        tmp_path / "sys",
        fakesys.Host(
            nodes={
                0: fakesys.NodeSpec(cpus=frozenset({ALL_CPUS[0]})),
                1: fakesys.NodeSpec(cpus=frozenset(ALL_CPUS) | {64}),
                2: fakesys.NodeSpec(cpus=frozenset()),
            }
        ),
    )
    monkeypatch.setenv("SGLANG_SYSFS_ROOT", str(root))
    monkeypatch.setattr(numa_utils, "get_libnuma", AvailableLibnuma)
    # The bind itself goes through placement's one libnuma: nodes 0-2 with memory.
    lib = FakeLibNuma(node_cpus={0: (), 1: (), 2: ()})
    monkeypatch.setattr(apply, "load_libnuma", lambda: lib)
    return lib


def test_legacy_bind_takes_the_nodes_allowed_cpus_for_every_thread_then_prefers_its_memory(
    legacy_host, monkeypatch
):
    # As sglang 0.5.23 (the node's CPUs intersected with the current affinity, then preferred memory), but
    # every thread of the process is moved, not only the calling one.
    moved = []
    monkeypatch.setattr(
        os, "sched_setaffinity", lambda tid, cpus: moved.append((tid, frozenset(cpus)))
    )
    monkeypatch.setattr(numa_utils, "_can_set_mempolicy", lambda: True)
    numa_utils.numa_bind_to_node(1)
    threads = {int(t) for t in os.listdir("/proc/self/task")}
    assert {tid for tid, _ in moved} >= threads and {cpus for _, cpus in moved} == {
        frozenset(ALL_CPUS)
    }
    # Preferred memory on the node, as upstream; then the pages touched so far move.
    assert legacy_host.calls == [
        ("set_preferred", (1,)),
        ("migrate_pages", (0, frozenset({0, 2}), frozenset({1}))),
    ]


def test_legacy_bind_of_a_node_without_cpus_leaves_the_cpus_alone(
    legacy_host, monkeypatch, caplog
):
    # Upstream's numa_run_on_node fails there (a node without CPUs gives an empty mask).
    monkeypatch.setattr(numa_utils, "_can_set_mempolicy", lambda: False)
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.INFO, logger=numa_utils.__name__):
        numa_utils.numa_bind_to_node(2)
    assert legacy_host.calls == [] and os.sched_getaffinity(0) == before
    assert (
        "NUMA memory policy not permitted; binding CPUs only to NUMA node 2"
        in caplog.text
    )


@pytest.mark.parametrize(
    "node, allowed, needle",
    [
        (0, {64}, "NUMA node 0 has no CPU cores allowed by the current affinity [64]"),
        (7, None, "NUMA node 7 does not exist on this host"),
    ],
)
def test_legacy_bind_failure_warns_or_raises_under_the_crash_setting(
    legacy_host, monkeypatch, caplog, node, allowed, needle
):
    if allowed is not None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING, logger=numa_utils.__name__):
        numa_utils.numa_bind_to_node(node)
    assert needle in caplog.text and legacy_host.calls == []
    with setting("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", "1"), pytest.raises(
        RuntimeError
    ) as raised:
        numa_utils.numa_bind_to_node(node)
    assert needle in str(raised.value) and os.sched_getaffinity(0) == before
