"""Upstream's numa_utils names on the placement core, with real spawn and numactl."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.spawn
import os
import shutil
import sys
import threading

import pytest

from sglang.srt.scheduler_launch.spawn_hook import armed_prefix
from sglang.srt.environ import envs
from sglang.srt.placement.types import PlacementError
from sglang.srt.placement.engine_args import EngineArgs, placement_for_gpu
from sglang.srt.utils import numa_utils
from sglang.srt.utils.numa_utils import (
    configure_subprocess,
    get_libnuma,
    get_numa_node_if_available,
    init_threads_binding,
)

from mp_launch_targets import affinity_report, exec_placement, unbound_placement

ALL_CPUS = sorted(os.sched_getaffinity(0))
ALL_TEXT = f"{ALL_CPUS[0]}-{ALL_CPUS[-1]}"


def _spawn_and_read_cpus(ctx_name: str = "spawn") -> str:
    ctx = multiprocessing.get_context(ctx_name)
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=affinity_report, args=(writer,))
    proc.start()
    writer.close()
    try:
        return reader.recv()
    finally:
        proc.join(30)
        reader.close()


@pytest.fixture(autouse=True)
def _nothing_left_armed():
    yield
    assert armed_prefix() is None


# --------------------------------------------------------------------------- configure_subprocess


def test_configure_subprocess_starts_the_child_under_numactl():
    with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
        assert armed_prefix() == (shutil.which("numactl"), "--physcpubind=1", "--membind=0")
        inside = _spawn_and_read_cpus()
    assert inside == "1"
    assert _spawn_and_read_cpus() == ALL_TEXT


def test_configure_subprocess_restores_on_error():
    executable = multiprocessing.spawn.get_executable()
    with pytest.raises(KeyError):
        with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
            raise KeyError("start failed")
    assert multiprocessing.spawn.get_executable() == executable
    assert _spawn_and_read_cpus() == ALL_TEXT


def test_configure_subprocess_in_two_threads_at_once():
    barrier = threading.Barrier(2)
    seen: dict[int, list[str]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(cpu: int) -> None:
        try:
            for _ in range(3):
                barrier.wait(timeout=60)
                with configure_subprocess(EngineArgs(), cpu, placement=exec_placement(0, cpu)):
                    seen[cpu].append(_spawn_and_read_cpus())
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(cpu,)) for cpu in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert seen == {0: ["0"] * 3, 1: ["1"] * 3}


def test_configure_subprocess_warns_when_nothing_was_spawned(caplog):
    with caplog.at_level(logging.WARNING, logger=numa_utils.__name__):
        with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
            assert _spawn_and_read_cpus("fork") == ALL_TEXT
    assert "no process was started with the spawn start method" in caplog.text


def test_configure_subprocess_notices_a_changed_spawn_executable(caplog):
    original = multiprocessing.spawn.get_executable()
    try:
        with caplog.at_level(logging.WARNING, logger=numa_utils.__name__):
            with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
                _spawn_and_read_cpus()
                multiprocessing.set_executable(os.path.realpath(sys.executable) + "-other")
        assert "spawn executable changed" in caplog.text
        multiprocessing.set_executable(os.fsdecode(original))
        with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True), pytest.raises(PlacementError, match="changed"):
            with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
                _spawn_and_read_cpus()
                multiprocessing.set_executable(os.path.realpath(sys.executable) + "-other")
    finally:
        multiprocessing.set_executable(os.fsdecode(original))


def test_configure_subprocess_does_nothing_without_an_exec_placement():
    with configure_subprocess(EngineArgs(), 0, placement=unbound_placement(0)):
        assert armed_prefix() is None
    with envs.SGLANG_NUMA_BIND_V2.override(False):
        with configure_subprocess(EngineArgs(), 0, placement=exec_placement(0, 1)):
            assert armed_prefix() is None


def test_configure_subprocess_resolves_this_host():
    # One NUMA node and no GPU here: the placement core decides there is nothing to bind.
    with configure_subprocess(EngineArgs(), 0):
        assert armed_prefix() is None
        assert _spawn_and_read_cpus() == ALL_TEXT


# --------------------------------------------------------------------------- node, libnuma


def test_numa_node_from_the_explicit_list_first():
    assert get_numa_node_if_available(EngineArgs(numa_node=[1, 0]), 1) == 0
    with envs.SGLANG_AUTO_NUMA_BIND.override(False):
        assert get_numa_node_if_available(EngineArgs(numa_node=[1, 0]), 0) == 1
    with pytest.raises(ValueError, match="--numa-node has 2 entries but GPU 2"):
        get_numa_node_if_available(EngineArgs(numa_node=[1, 0]), 2)


def test_numa_node_discovery():
    with envs.SGLANG_AUTO_NUMA_BIND.override(False):
        assert get_numa_node_if_available(EngineArgs(), 0) is None
    # A single-node host has nothing to choose.
    assert get_numa_node_if_available(EngineArgs(), 0) is None


def test_get_libnuma_returns_the_loaded_cdll_as_upstream():
    import ctypes

    lib = get_libnuma()
    assert isinstance(lib, ctypes.CDLL)
    assert lib.numa_available() >= 0
    assert get_libnuma() is lib


# --------------------------------------------------------------------------- init_threads_binding


def test_init_threads_binding_from_groups(caplog):
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"), caplog.at_level(logging.INFO, logger=numa_utils.__name__):
        assert init_threads_binding(numa_index=1, world_size=2) == "1"
        # A router runs each DP worker as its own one-rank engine: the index still counts across the groups.
        assert init_threads_binding(numa_index=1, world_size=1) == "1"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0] == "init_threads_binding: numa_index=1, world_size=2, local_omp_cpuid=1"


def test_init_threads_binding_from_nodes():
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("all"):
        assert init_threads_binding(numa_index=0, world_size=1) == ALL_TEXT
        with pytest.raises(PlacementError, match="rank index 1 .* has no NUMA node"):
            init_threads_binding(numa_index=1, world_size=2)


def test_init_threads_binding_rejects_bad_groups():
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        with pytest.raises(PlacementError, match="has 2 group"):
            init_threads_binding(numa_index=2, world_size=3)
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|x"):
        with pytest.raises(ValueError, match="not a cpulist"):
            init_threads_binding(numa_index=1, world_size=2)


def test_gpu_helpers_answer_for_the_gpu_they_are_given(tmp_path, monkeypatch):
    """Upstream's helpers take a GPU id: GPU 2 of a two-socket host is on node 1, whichever rank asks."""
    import fakesys

    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    server_args = EngineArgs(tp_size=4)
    with envs.SGLANG_SYSFS_ROOT.override(str(root)):
        assert [get_numa_node_if_available(server_args, gpu) for gpu in range(4)] == [0, 0, 1, 1]
        placement = placement_for_gpu(server_args, 2)
        # This process may only use CPUs of node 0, so the rank stays unbound; its reasons name GPU 2's node.
        assert (placement.tp_rank, placement.gpu_id, placement.pci) == (2, 2, "0000:38:00.0")
        assert "node 1 from PCI 0000:38:00.0" in placement.reasons
        # A GPU id no rank uses is placed as upstream places any id: by that GPU's own node.
        alone = placement_for_gpu(EngineArgs(tp_size=2), 3)
        assert (alone.gpu_id, alone.pci) == (3, "0000:48:00.0")
        assert "node 1 from PCI 0000:48:00.0" in alone.reasons
