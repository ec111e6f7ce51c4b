"""SGLANG_SET_CPU_AFFINITY gives a GPU the same CPUs on both of sglang's paths.

A spawned scheduler starts under numactl inside ``configure_subprocess`` (the argv a
numactl stand-in records); a Ray ``SchedulerActor`` is placed by Ray's id for its GPU,
under the one-GPU ``CUDA_VISIBLE_DEVICES`` Ray gives it. Neither knows its sibling
ranks, so the slice must come from the host's topology alone: 2 nodes of 4 cores x 2
threads, 2 GPUs per node.
"""

from __future__ import annotations

import os
import sys

import fakesys
import pytest
from spawn_support import (
    args,
    numactl_calls,
    numactl_standin,
    start_rank,
    use_fake_host,
)

from sglang.srt.placement.types import (
    DeviceIndex,
    DeviceRef,
    Launcher,
    ProcessAffinity,
)

SHAPE = fakesys.Shape(sockets=2, cores_per_node=4, threads_per_core=2, gpus_per_node=2)
# GPU i's slice: each node's cores split between its two GPUs in PCI order.
SLICES = ["0,1,8,9", "2,3,10,11", "4,5,12,13", "6,7,14,15"]


@pytest.fixture
def host(tmp_path, monkeypatch):
    from sglang.srt.utils import numa_utils

    use_fake_host(monkeypatch, fakesys.write_sysfs(tmp_path / "sys", SHAPE))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SGLANG_SET_CPU_AFFINITY", "1")
    # This host has fewer CPUs than the tree: the process may use all 16.
    monkeypatch.setattr(numa_utils.os, "sched_getaffinity", lambda pid: set(range(16)))
    # ... and the memory of both nodes (this host's Mems_allowed has node 0 only).
    monkeypatch.setattr(
        numa_utils,
        "read_process_affinity",
        lambda: ProcessAffinity(frozenset(range(16)), frozenset({0, 1}), "test"),
    )
    directory, log = numactl_standin(tmp_path / "numactl", "record")
    monkeypatch.setenv("PATH", f"{directory}:{os.environ['PATH']}")
    return log


def spawned_argv(log, gpu: int) -> list[str]:
    out = start_rank(args(tp_size=4), gpu)
    assert out["report"] is not None and not out["warnings"], out
    spawn = [c for c in numactl_calls(log) if "-c" in c][-1]
    return spawn[: spawn.index(sys.executable)]


def actor_argv(monkeypatch, gpu: int) -> list[str]:
    from sglang.srt.utils import numa_utils

    # What Ray gives an actor holding one GPU: that GPU alone as index 0, and its id.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(gpu))
    ray_gpu = DeviceRef(DeviceIndex.PHYSICAL_GPU, gpu)
    p = numa_utils.place_gpu_id(args(tp_size=4), ray_gpu, launcher=Launcher.RAY)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert p.strategy == "in-process" and not p.degraded, p
    (node,) = p.mem_nodes
    return [f"--physcpubind={','.join(map(str, sorted(p.cpus)))}", f"--membind={node}"]


def test_a_gpus_slice_is_the_same_spawned_and_as_a_ray_actor(host, monkeypatch):
    for gpu, cpus in enumerate(SLICES):
        expected = [f"--physcpubind={cpus}", f"--membind={gpu // 2}"]
        assert spawned_argv(host, gpu) == expected
        assert actor_argv(monkeypatch, gpu) == expected
