"""Scheduler actors binding themselves, on the session's Ray cluster.

The cluster declares 4 GPUs; its raylet reads a fake /sys of three NUMA nodes:
GPUs 0 and 1 on node 0, GPUs 2 and 3 on node 1, each node holding one real
CPU of this host, and node 2 only CPUs this host lacks (``ray_gpu_cluster``).
sglang's own ``SchedulerActor`` runs up to its ``Scheduler``, which the job's setup
hook replaces with a stand-in that reports where its process runs and the placement
its configure step applied (``upstream_standins``).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any, Iterator

import fakesys
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray_gpu_cluster import GPU_NODE, NO_CPU_NODE

from sglang.srt.ray.scheduler_actor import SchedulerActor

pytestmark = pytest.mark.ray

TIMEOUT_S = 180.0
ONE_GPU = [{"CPU": 0.01, "GPU": 1}]


def server_args(**kwargs: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="/nonexistent", **kwargs)


def leftovers() -> tuple[list[str], list[str]]:
    actors = [
        n for n in ray.util.list_named_actors() if n.startswith("sglang_scheduler")
    ]
    groups = [
        g["placement_group_id"]
        for g in ray.util.placement_group_table().values()
        if g["state"] != "REMOVED"
    ]
    return actors, groups


@pytest.fixture
def cluster(ray_cluster):
    yield ray_cluster
    # ray.kill returns before the actor is gone: give Ray a moment, then insist.
    deadline = time.monotonic() + 30
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])


@contextlib.contextmanager
def group(bundles: list[dict], strategy: str = "PACK") -> Iterator[tuple[Any, list]]:
    """A reserved placement group and a list for its actors; both are gone afterwards."""
    pg = placement_group(bundles, strategy=strategy)
    actors: list = []
    try:
        ray.get(pg.ready(), timeout=TIMEOUT_S)
        yield pg, actors
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)


def in_bundle(actor_class: Any, pg: Any, bundle: int, env: dict, *args: Any) -> Any:
    """An actor created as upstream's ``_create_scheduler_actor`` does, under ``env``
    (which upstream's call cannot pass: a raylet's own environment in production)."""
    return actor_class.options(
        num_cpus=0,
        num_gpus=1,
        runtime_env={"env_vars": env},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        ),
    ).remote(*args)


def reports(actors: list) -> list[dict]:
    return ray.get([a.get_info.remote() for a in actors], timeout=TIMEOUT_S)


def gpu_less_tree(tmp_path) -> dict:
    """A raylet's workers' host with no GPU in sysfs."""
    real = sorted(os.sched_getaffinity(0))
    tree = str(
        fakesys.write_sysfs(
            tmp_path / "no-gpus",
            fakesys.Host(
                nodes={
                    0: fakesys.NodeSpec(cpus=real[:1]),
                    1: fakesys.NodeSpec(cpus=real[1:2]),
                },
                pci=[fakesys.host_bridge(0)],
            ),
        )
    )
    return {"PLACEMENT_TESTS_SYSFS": tree}


def test_actors_sharing_a_bundle_each_bind_to_their_own_gpus_node_every_thread(
    cluster,
):
    # RayEngine's own shape: one bundle of the node's GPUs, which sit on two NUMA
    # nodes, each rank created by upstream's _create_scheduler_actor.
    from sglang.srt.ray import engine

    args = server_args(tp_size=4, device="cuda")
    with group([{"CPU": 1, "GPU": 4}], strategy="STRICT_PACK") as (pg, actors):
        for tp in range(4):
            actors.append(
                engine._create_scheduler_actor(
                    pg=pg, bundle_idx=0, gpu_id=tp, server_args=args,
                    port_args=None, tp_rank=tp, pp_rank=0, dp_rank=0,
                    dist_init_addr="127.0.0.1:29999", rank0_node_ip="127.0.0.1",
                )
            )  # fmt: skip
        infos = reports(actors)
    assert sorted(i["configured_gpu_id"] for i in infos) == [0, 1, 2, 3]
    for info in infos:
        gpu, placement = info["configured_gpu_id"], info["placement"]
        # Its own device, by Ray's id: under Ray's CUDA_VISIBLE_DEVICES=<gpu>, index
        # 0 would name GPU 0.
        assert info["cuda_visible_devices"] == str(gpu)
        assert (placement["gpu_id"], placement["numbering"]) == (gpu, "physical")
        assert placement["strategy"] == "in-process" and not placement["degraded"]
        assert placement["numa_node"] == GPU_NODE[gpu]
        cpu = cluster.gpu_cpu(gpu)
        # Every thread was moved (Ray's worker runs several).
        assert info["cpus"] == [cpu] and info["thread_cpu_sets"] == [(cpu,)]
        # Memory is bound where this host has the node's memory: node 0 (the fake
        # node 1 has none here: membind, then preferred, are refused).
        expected = ("bind", [0]) if GPU_NODE[gpu] == 0 else ("default", [])
        assert (info["policy"], info["policy_nodes"]) == expected


def test_a_gpu_its_node_cannot_identify_leaves_the_actor_unbound_with_the_reason(
    cluster, tmp_path
):
    with group(ONE_GPU) as (pg, actors):
        args = (server_args(tp_size=1, device="cuda"), None, 0, 0, 0, 0)
        actors.append(in_bundle(SchedulerActor, pg, 0, gpu_less_tree(tmp_path), *args))
        (info,) = reports(actors)
    placement = info["placement"]
    assert placement["strategy"] == "none" and placement["degraded"]
    (why,) = placement["reasons"]
    gpu = info["configured_gpu_id"]
    assert why.startswith(f"no NUMA node found for Ray GPU {gpu}")
    assert f"lists 0 NVIDIA GPU(s), none at index {gpu}" in why
    assert info["cpus"] == sorted(os.sched_getaffinity(0))


def test_under_crash_setting_an_unidentified_gpu_fails_the_actor_before_its_scheduler(
    cluster, tmp_path
):
    env = {**gpu_less_tree(tmp_path), "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"}
    args = (server_args(tp_size=1, device="cuda"), None, 0, 0, 0, 0)
    with group(ONE_GPU) as (pg, actors):
        actors.append(in_bundle(SchedulerActor, pg, 0, env, *args))
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(actors[0].get_info.remote(), timeout=TIMEOUT_S)
    message = str(info.value)
    assert "PlacementError: no NUMA node found for Ray GPU" in message
    assert "lists 0 NVIDIA GPU(s)" in message and "skipping NUMA binding" in message
    # Raised in the bind of configure_scheduler_process, before the Scheduler was built.
    frames = re.findall(r'upstream_standins.py", line \d+, in (\w+)', message)
    assert frames == ["configure_scheduler_process"], frames


def test_a_rank_less_bound_than_intended_runs_unbound_with_the_reason(cluster):
    args = server_args(tp_size=1, device="cuda", numa_node=[NO_CPU_NODE] * 4)
    with group(ONE_GPU) as (pg, actors):
        actors.append(in_bundle(SchedulerActor, pg, 0, {}, args, None, 0, 0, 0, 0))
        (info,) = reports(actors)
    placement = info["placement"]
    assert placement["strategy"] == "none" and placement["degraded"]
    assert any(
        f"NUMA node {NO_CPU_NODE} has no CPU cores allowed by the current affinity" in w
        for w in placement["reasons"]
    )
    assert info["cpus"] == sorted(os.sched_getaffinity(0))


def test_cpu_device_actors_bind_to_the_cpus_of_the_id_bootstrap_will_use(cluster):
    real = sorted(os.sched_getaffinity(0))
    groups = f"{real[1]}|{real[0]}"  # rank index 0 on the second CPU, 1 on the first
    env = {"SGLANG_CPU_OMP_THREADS_BIND": groups}
    with group(ONE_GPU * 2) as (pg, actors):
        for tp in range(2):
            # RayEngine passes gpu_id 0 in a custom group.
            args = (server_args(tp_size=2, device="cpu"), None, 0, tp, 0, 0)
            actors.append(in_bundle(SchedulerActor, pg, tp, env, *args))
        infos = reports(actors)
    # Bootstrap's init_threads_binding(numa_index=get_device().gpu_id) sees the id
    # sglang's actor publishes: Ray's GPU id, which configure_scheduler_process got.
    assert sorted(i["configured_gpu_id"] for i in infos) == [0, 1]
    for info in infos:
        cpu = real[1 - info["configured_gpu_id"]]
        assert info["cpus"] == [cpu] and info["thread_cpu_sets"] == [(cpu,)]
        assert info["omp_bind_env"] == groups
        assert info["placement"]["numbering"] == "cpu-rank"


def test_set_cpu_affinity_without_a_node_keeps_upstreams_slice_in_the_actor(
    cluster, tmp_path
):
    # One NUMA node here: the rank's node is unknown, so the setting's own rule runs.
    real = sorted(os.sched_getaffinity(0))
    one_node = fakesys.write_sysfs(
        tmp_path / "one", fakesys.Host(nodes={0: fakesys.NodeSpec(cpus=real)})
    )
    env = {"PLACEMENT_TESTS_SYSFS": str(one_node), "SGLANG_SET_CPU_AFFINITY": "1"}
    args = (server_args(tp_size=2, device="cuda"), None, 0, 0, 0, 0)
    with group(ONE_GPU) as (pg, actors):
        actors.append(in_bundle(SchedulerActor, pg, 0, env, *args))
        (info,) = reports(actors)
    assert info["placement"]["strategy"] == "cpu-affinity"
    assert info["cpus"] == sorted(map(int, info["placement"]["cpus"].split(",")))


def test_with_bind_v2_off_the_legacy_bind_of_configure_scheduler_process_places_it(
    cluster,
):
    env = {"SGLANG_NUMA_BIND_V2": "0"}
    args = (server_args(tp_size=1, device="cuda", numa_node=[1] * 4), None, 0, 0, 0, 0)
    with group(ONE_GPU) as (pg, actors):
        actors.append(in_bundle(SchedulerActor, pg, 0, env, *args))
        (info,) = reports(actors)
    # The legacy bind moved the process to node 1's CPU with a preferred policy.
    assert info["cpus"] == [cluster.node_cpu[1]]
    assert info["placement"]["strategy"] == "v1" and info["policy"] != "bind"
