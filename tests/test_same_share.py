"""exclusive and core-complex give a GPU the same CPUs on both of sglang's paths.

A spawned scheduler starts under numactl inside ``configure_subprocess`` (the
argv a numactl stand-in records); a Ray ``SchedulerActor`` places itself with
``bind_scheduler_actor``'s decision, under the one-GPU ``CUDA_VISIBLE_DEVICES``
Ray gives it and Ray's id for that GPU. Neither knows its sibling ranks, so the
share must come from the host's topology alone: 2 nodes of 4 cores x 2
threads, 2 GPUs and 2 L3 groups per node.
"""

from __future__ import annotations

import os
import sys

import fakesys
import pytest
from spawn_support import args, numactl_calls, numactl_standin, start_rank

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import ProcessAffinity, RankIdentity

SHAPE = fakesys.Shape(
    sockets=2, cores_per_node=4, threads_per_core=2, gpus_per_node=2, l3_per_node=2
)
# GPU i's share: exclusive splits each node's cores between its two GPUs in PCI
# order, and with two L3 groups of two cores per node core-complex agrees.
SHARES = ["0-1,8-9", "2-3,10-11", "4-5,12-13", "6-7,14-15"]


@pytest.fixture
def l3_host(tmp_path, monkeypatch):
    from sglang.srt.placement import resolve

    monkeypatch.setenv(
        "SGLANG_SYSFS_ROOT", str(fakesys.write_sysfs(tmp_path / "sys", SHAPE))
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # This host has fewer CPUs than the tree: the process may use all 16.
    monkeypatch.setattr(
        resolve,
        "read_process_affinity",
        lambda: ProcessAffinity(
            cpus=frozenset(range(16)), mems=frozenset({0, 1}), source="test"
        ),
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
    from sglang.srt.scheduler_placement.ray_rank import actor_placement

    # What Ray gives an actor holding one GPU: that GPU alone as index 0, and its id.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(gpu))
    rank = RankIdentity(dp_rank=0, pp_rank=0, tp_rank=gpu, gpu_id=gpu)
    p = actor_placement(args(tp_size=4), rank=rank, assigned_gpus=[str(gpu)])
    # The actor places by Ray's id without touching its own view: torch and sglang's
    # readers in the actor (model_runner, bootstrap's logs) still see Ray's one GPU.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert p.strategy == "in-process" and not p.degraded, p
    (node,) = p.mem_nodes
    return [f"--physcpubind={format_cpulist(p.cpus)}", f"--membind={node}"]


@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
def test_a_gpus_share_is_the_same_spawned_and_as_a_ray_actor(
    l3_host, monkeypatch, mode
):
    monkeypatch.setenv("SGLANG_NUMA_AFFINITY_MODE", mode)
    for gpu, share in enumerate(SHARES):
        expected = [f"--physcpubind={share}", f"--membind={gpu // 2}"]
        assert spawned_argv(l3_host, gpu) == expected
        assert actor_argv(monkeypatch, gpu) == expected
