"""Upstream's numa_utils names on the placement core, with real spawn and numactl."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.spawn
import os
import shlex
import shutil
import stat
import sys
from typing import Iterator

import fakesys
import pytest
from conftest import setting
from fakelibnuma import FakeLibNuma
from spawn_support import args, use_fake_host

from sglang.srt.placement import apply
from sglang.srt.placement.libnuma import MPOL_PREFERRED
from sglang.srt.placement.types import PlacementError, ProcessAffinity
from sglang.srt.utils import numa_utils
from sglang.srt.utils.numa_utils import (
    _create_numactl_executable,
    configure_subprocess,
    get_libnuma,
    get_numa_node_if_available,
    init_threads_binding,
)


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


def spawn_executable() -> str:
    return os.fsdecode(multiprocessing.spawn.get_executable())


@pytest.fixture(autouse=True)
def _groups_and_the_spawn_executable_restored(monkeypatch):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{ALL_CPUS[0]}|{ALL_CPUS[-1]}")
    before = spawn_executable()
    yield
    assert spawn_executable() == before


# --------------------------------------------------------------------------- configure_subprocess


def test_configure_subprocess_starts_its_rank_through_a_private_wrapper():
    with configure_subprocess(CPU_RANK, 1):
        wrapper = spawn_executable()
        directory = os.path.dirname(wrapper)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(wrapper).st_mode) == 0o700
        exec_line = open(wrapper).read().splitlines()[1]
        assert shlex.split(exec_line)[:4] == [
            "exec",
            shutil.which("numactl"),
            f"--physcpubind={ALL_CPUS[-1]}",
            "--membind=0",
        ]
        assert spawn_and_read_cpus() == [ALL_CPUS[-1]]
    assert not os.path.exists(directory)  # gone once the child left the shell
    assert spawn_and_read_cpus() == ALL_CPUS


def test_the_wrapper_quotes_every_word(tmp_path):
    odd = tmp_path / "a dir; $(touch x)"
    odd.mkdir()
    original = spawn_executable()
    multiprocessing.set_executable(str(odd / "python"))
    try:
        path, _ = _create_numactl_executable(
            "--physcpubind=0", numactl=str(odd / "numactl")
        )
    finally:
        multiprocessing.set_executable(original)
    try:
        words = shlex.split(open(path).read().splitlines()[1])
        assert words == [
            "exec",
            str(odd / "numactl"),
            "--physcpubind=0",
            str(odd / "python"),
            "$@",
        ]
    finally:
        shutil.rmtree(os.path.dirname(path))


def test_configure_subprocess_removes_the_wrapper_on_error_and_without_a_spawn():
    for raised in (True, False):
        with contextlib.suppress(KeyError), configure_subprocess(CPU_RANK, 1):
            directory = os.path.dirname(spawn_executable())
            if raised:
                raise KeyError("start failed")
        assert not os.path.exists(directory)
    assert spawn_and_read_cpus() == ALL_CPUS


def test_configure_subprocess_refuses_a_changed_spawn_executable():
    original = spawn_executable()
    try:
        with pytest.raises(PlacementError, match="changed"):
            with configure_subprocess(CPU_RANK, 1):
                multiprocessing.set_executable(os.path.realpath(sys.executable) + "-x")
    finally:
        multiprocessing.set_executable(original)


def test_configure_subprocess_does_nothing_where_upstream_does_nothing(monkeypatch):
    # A GPU on this one-node host, and any rank with SGLANG_NUMA_BIND_V2=0.
    before = spawn_executable()
    for engine, settings in (
        (args(tp_size=2), {}),
        (CPU_RANK, {"SGLANG_NUMA_BIND_V2": "0"}),
        (args(device="npu"), {}),
    ):
        with contextlib.ExitStack() as stack:
            for name, value in settings.items():
                stack.enter_context(setting(name, value))
            with configure_subprocess(engine, 1):
                assert spawn_executable() == before


def test_a_device_sglang_does_not_place_reads_no_host_fact(monkeypatch):
    """As upstream, which returns before any sysfs read: a host without /sys (macOS
    with mps) or with an unreadable one starts its ranks unbound."""
    from sglang.srt.placement import topology

    monkeypatch.setattr(topology, "SYSFS_ROOT", "/nonexistent")
    before = spawn_executable()
    for device in ("mps", "npu"):
        with configure_subprocess(args(device=device), 0):
            assert spawn_executable() == before
    with setting("SGLANG_AUTO_NUMA_BIND", False):
        with configure_subprocess(args(tp_size=2), 0):
            assert spawn_executable() == before


# --------------------------------------------------------------------------- node, libnuma


def test_numa_node_from_the_explicit_list_first():
    assert get_numa_node_if_available(args(numa_node=[1, 0]), 1) == 0
    with setting("SGLANG_AUTO_NUMA_BIND", False):
        assert get_numa_node_if_available(args(numa_node=[1, 0]), 0) == 1
    with pytest.raises(ValueError, match="--numa-node has 2 entries .* GPU 2"):
        get_numa_node_if_available(args(numa_node=[1, 0]), 2)


def test_numa_node_discovery_on_a_two_socket_host_answers_for_the_gpu_given(
    tmp_path, monkeypatch
):
    """GPU 2 of a two-socket host is on node 1, whichever rank asks; one GPU identified per call."""
    use_fake_host(monkeypatch, fakesys.two_sockets_four_gpus(tmp_path / "sys"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
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
    use_fake_host(monkeypatch, root)
    from sglang.srt.placement import topology

    node1 = frozenset(range(8, 16)) | frozenset(range(24, 32))
    allowed = topology.ProcessAffinity(node1, frozenset({1}), "this process")
    monkeypatch.setattr(numa_utils, "read_process_affinity", lambda: allowed)
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
    use_fake_host(monkeypatch, root)
    monkeypatch.setattr(numa_utils, "get_libnuma", AvailableLibnuma)
    # The bind itself goes through placement's one libnuma: nodes 0-2 with memory.
    lib = FakeLibNuma(node_cpus={0: (), 1: (), 2: ()})
    monkeypatch.setattr(apply, "load_libnuma", lambda: lib)
    # ... and this process may use their memory (this host's Mems_allowed has node 0 only).
    monkeypatch.setattr(
        numa_utils,
        "read_process_affinity",
        lambda: ProcessAffinity(
            frozenset(os.sched_getaffinity(0)), frozenset({0, 1, 2}), "this process"
        ),
    )
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
        ("move_private_pages", (MPOL_PREFERRED, frozenset({1}))),
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
