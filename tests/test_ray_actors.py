"""Scheduler actors created as sglang's RayEngine creates them, on the session's Ray cluster.

Every actor here is created through the overlaid
``sglang.srt.ray.engine._create_scheduler_actor`` (or, for an older caller,
as the actor class itself), on a local cluster declaring 4 GPUs whose raylet
reads a fake /sys of three NUMA nodes: GPUs 0 and 1 on node 0, GPUs 2 and 3
on node 1, each node holding one real CPU of this host, and node 2 only CPUs
this host lacks (``ray_gpu_cluster``). sglang's own ``SchedulerActor``, given a
real ``ServerArgs``, builds the stand-in Scheduler (``upstream_standins``),
which reports the CPUs and memory policy its process has. Its worker imports
sglang's whole engine (about 20 s here), so the tests of what happens before
the scheduler is built use verify's probe instead: the same ``SchedulerRank``
placement steps, in a light worker, with ``PlanArgs`` (the fields
``_create_scheduler_actor`` reads from ``ServerArgs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Any, Iterator

import fakesys
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray_gpu_cluster import GPU_NODE, NO_CPU_NODE

from sglang.srt.environ import envs
from sglang.srt.placement.cpulist import parse_cpulist
from sglang.srt.placement_tools.plan_args import PlanArgs
from sglang.srt.placement_tools.verify_ray import ProbeActor
from sglang.srt.scheduler_placement import ray_actors

pytestmark = pytest.mark.ray

TIMEOUT_S = 180.0
FAILURE_LOGGER = "sglang.srt.scheduler_placement.spawn"


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
        ray_actors.forget_group(pg)


def create(
    pg: Any, actors: list, args: Any, *, bundle: int, gpu_id: int, tp: int, dp: int = 0
) -> Any:
    """What RayEngine does for one rank: the overlaid engine's ``_create_scheduler_actor``; with ``PlanArgs``
    the actor is verify's probe."""
    from sglang.srt.ray import engine

    probe = isinstance(args, PlanArgs)
    with (
        ray_actors.scheduler_actor_class(ProbeActor)
        if probe
        else contextlib.nullcontext()
    ):
        actor = engine._create_scheduler_actor(
            pg=pg,
            bundle_idx=bundle,
            gpu_id=gpu_id,
            server_args=args,
            port_args=None,
            tp_rank=tp,
            pp_rank=0,
            dp_rank=dp,
            dist_init_addr="127.0.0.1:29999",
            rank0_node_ip="127.0.0.1",
        )
    actors.append(actor)
    return actor


def started(actors: list) -> list[tuple[dict, dict]]:
    """(what the actor's process reports, the actor's read-back) per actor; ``cpus`` is the process's CPUs."""
    infos = ray.get([a.get_info.remote() for a in actors], timeout=TIMEOUT_S)
    bindings = ray.get([a.binding_report.remote() for a in actors], timeout=TIMEOUT_S)
    for info in infos:
        if "observed" in info:  # the probe
            info["cpus"] = sorted(parse_cpulist(info["observed"]["cpus"]))
    return list(zip(infos, bindings))


def ray_gpu(binding: dict) -> int:
    (gpu,) = binding["accelerator_ids"]
    return int(gpu)


ONE_GPU = [{"CPU": 0.01, "GPU": 1}]


# ----------------------------------------------------------------------------- RayEngine's own shapes
# (A bundle whose GPUs bind alike: tests/test_upstream_shapes.py, with sglang's own SchedulerActor.)


def test_a_bundle_whose_gpus_bind_differently_binds_each_actor_in_process_for_the_gpu_it_got(
    cluster,
):
    args = PlanArgs(tp_size=4, device="cuda")
    with group([{"CPU": 1, "GPU": 4}], strategy="STRICT_PACK") as (pg, actors):
        for tp in range(4):
            create(pg, actors, args, bundle=0, gpu_id=tp, tp=tp)
        results = started(actors)
    assert sorted(ray_gpu(b) for _, b in results) == [0, 1, 2, 3]
    for info, binding in results:
        gpu = ray_gpu(binding)
        placement = binding["placement"]
        assert placement["strategy"] == "in-process"
        assert (
            "bind differently; the actor binds in-process once it knows its id"
            in placement["reasons"][-1]
        )
        assert (
            placement["pci"] == cluster.gpus[gpu]
            and placement["numa_node"] == GPU_NODE[gpu]
        )
        assert info["cpus"] == [cluster.gpu_cpu(gpu)]
        assert binding["mismatches"] == []


# ----------------------------------------------------------------------------- an actor without a plan


def test_an_actor_without_a_plan_places_the_gpu_ray_gave_it(cluster):
    args = PlanArgs(tp_size=4, device="cuda")
    # A custom group of one-GPU bundles, each actor created as an older caller does: upstream's positional
    # arguments, gpu_id 0 for all (what RayEngine passes in a custom group), no plan.
    with group(ONE_GPU * 4) as (pg, actors):
        for tp in range(4):
            actors.append(
                ProbeActor.options(
                    num_cpus=0,
                    num_gpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=tp
                    ),
                ).remote(args, None, 0, tp, 0, 0)
            )
        results = started(actors)
    assert sorted(ray_gpu(b) for _, b in results) == [0, 1, 2, 3]
    for info, binding in results:
        gpu = ray_gpu(binding)
        placement = binding["placement"]
        # Its own device, by Ray's id: under Ray's CUDA_VISIBLE_DEVICES=<gpu>, index 0 would name GPU 0.
        assert info["gpu_id"] == gpu
        assert placement["gpu_id"] == gpu and placement["pci"] == cluster.gpus[gpu]
        assert placement["numa_node"] == GPU_NODE[gpu] and placement["cpus"] == str(
            cluster.gpu_cpu(gpu)
        )
        assert placement["strategy"] == "in-process" and not placement["warning"]
        assert placement["reasons"][0].startswith(
            "the actor was created without a plan from its node"
        )
        assert info["cpus"] == [cluster.gpu_cpu(gpu)] and binding["mismatches"] == []
        assert binding["planned_on"] is None


def gpu_less_tree(tmp_path) -> str:
    real = sorted(os.sched_getaffinity(0))
    return str(
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


def unplanned_actor(pg: Any, args: Any, env: dict) -> Any:
    """sglang's own SchedulerActor created without a plan (as an older caller does), under ``env``."""
    from sglang.srt.ray.scheduler_actor import SchedulerActor

    return SchedulerActor.options(
        num_cpus=0,
        num_gpus=1,
        runtime_env={"env_vars": env},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0
        ),
    ).remote(args, None, 0, 0, 0, 0)


def test_a_gpu_its_node_cannot_identify_leaves_the_actor_unbound_with_the_reason(
    cluster, tmp_path
):
    args = PlanArgs(tp_size=1, device="cuda")
    with group(ONE_GPU) as (pg, actors):
        actors.append(
            ProbeActor.options(
                num_cpus=0,
                num_gpus=1,
                runtime_env={
                    "env_vars": {"SGLANG_SYSFS_ROOT": gpu_less_tree(tmp_path)}
                },
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0
                ),
            ).remote(args, None, 0, 0, 0, 0)
        )
        ((info, binding),) = started(actors)
    placement = binding["placement"]
    assert placement["strategy"] == "none" and placement["warning"]
    (why,) = [why for why in placement["reasons"] if why.startswith("GPU 0 ")]
    assert (
        "no PCI address" in why
        and "lists 0 NVIDIA GPU(s), none at index 0 (Ray GPU id '0'" in why
    )
    assert info["cpus"] == sorted(os.sched_getaffinity(0))


def test_a_gpu_its_node_cannot_identify_fails_the_actor_before_its_scheduler_under_crash_setting(
    cluster, tmp_path
):
    args = server_args(tp_size=1, device="cuda")
    env = {
        "SGLANG_SYSFS_ROOT": gpu_less_tree(tmp_path),
        "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1",
    }
    with group(ONE_GPU) as (pg, actors):
        actors.append(unplanned_actor(pg, args, env))
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(actors[0].get_info.remote(), timeout=TIMEOUT_S)
    message = str(info.value)
    assert (
        "PlacementError: DP0 PP0 TP0: " in message
        and "lists 0 NVIDIA GPU(s), none at index 0" in message
    )
    assert "skipping NUMA binding for DP0 PP0 TP0." in message
    assert (
        "upstream_standins" not in message
    )  # raised in _place, before the Scheduler was built


# ----------------------------------------------------------------------------- CPU-device actors


def test_cpu_device_actors_start_under_numactl_on_the_cpus_of_the_id_bootstrap_will_use(
    cluster,
):
    real = sorted(os.sched_getaffinity(0))
    groups = (
        f"{real[1]}|{real[0]}"  # rank index 0 on the second CPU, index 1 on the first
    )
    args = server_args(tp_size=2, device="cpu")
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override(groups), group(ONE_GPU * 2) as (
        pg,
        actors,
    ):
        for tp in range(2):
            create(
                pg, actors, args, bundle=tp, gpu_id=0, tp=tp
            )  # RayEngine passes 0 in a custom group
        results = started(actors)
    assert sorted(ray_gpu(b) for _, b in results) == [0, 1]
    for info, binding in results:
        index = ray_gpu(binding)
        placement = binding["placement"]
        # Bootstrap's init_threads_binding(numa_index=get_device().gpu_id) sees the id sglang's actor publishes:
        # Ray's GPU id, which configure_scheduler_process got too; the rank was placed by that same index.
        assert info["configured_gpu_id"] == index and placement["gpu_id"] == index
        assert (
            info["omp_bind_env"] == groups
        )  # the driver's setting reached the rank's own code
        cpu = real[1 - index]
        assert (
            placement["strategy"] == "exec"
            and placement["numactl_args"][0] == f"--physcpubind={cpu}"
        )
        assert info["cpus"] == [cpu] and binding["mismatches"] == []


def test_cpu_device_actors_sharing_a_bundle_bind_in_process_by_the_id_they_got(cluster):
    args = PlanArgs(tp_size=2, device="cpu")
    with group([{"CPU": 1, "GPU": 2}], strategy="STRICT_PACK") as (pg, actors):
        for tp in range(2):
            create(pg, actors, args, bundle=0, gpu_id=tp, tp=tp)
        results = started(actors)
    for info, binding in results:
        index = ray_gpu(binding)
        placement = binding["placement"]
        # SGLANG_CPU_OMP_THREADS_BIND=all: rank index i runs on NUMA node i's CPUs.
        assert placement["strategy"] == "in-process" and placement["numa_node"] == index
        assert info["cpus"] == [cluster.node_cpu[index]] and info["gpu_id"] == index


# ----------------------------------------------------------------------------- the failure policy


def test_a_rank_less_bound_than_intended_gets_one_warning_naming_it(cluster, caplog):
    caplog.set_level(logging.WARNING)
    args = PlanArgs(tp_size=2, device="cuda", numa_node=[NO_CPU_NODE] * 4)
    with group(ONE_GPU * 2) as (pg, actors):
        for tp in range(2):
            create(pg, actors, args, bundle=tp, gpu_id=0, tp=tp)
        results = started(actors)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for tp in range(2):
        mine = [w for w in warnings if w.startswith(f"DP0 PP0 TP{tp}: ")]
        assert len(mine) == 1, warnings
        assert (
            f"NUMA node {NO_CPU_NODE} has no CPU cores allowed by the current affinity"
            in mine[0]
        )
        assert mine[0].endswith(f"skipping NUMA binding for DP0 PP0 TP{tp}.")
    for info, binding in results:
        assert (
            binding["placement"]["strategy"] == "none"
            and binding["placement"]["warning"]
        )
        assert info["cpus"] == sorted(os.sched_getaffinity(0))


def test_under_crash_setting_a_rank_less_bound_than_intended_fails_before_its_actor_exists(
    cluster,
):
    args = PlanArgs(tp_size=1, device="cuda", numa_node=[NO_CPU_NODE] * 4)
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True), group(ONE_GPU) as (
        pg,
        actors,
    ):
        with pytest.raises(
            RuntimeError,
            match=r"^DP0 PP0 TP0: .*NUMA node 2 has no CPU cores allowed .*"
            r"skipping NUMA binding for DP0 PP0 TP0\.$",
        ):
            create(pg, actors, args, bundle=0, gpu_id=0, tp=0)
        assert actors == [] and leftovers()[0] == []


def test_under_crash_setting_an_actor_that_learns_its_gpu_fails_before_building_its_scheduler(
    cluster,
):
    # In a bundle of two GPUs the driver cannot know which one an actor gets: the actor decides.
    args = server_args(tp_size=2, device="cuda", numa_node=[NO_CPU_NODE] * 4)
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True):
        with group([{"CPU": 1, "GPU": 2}], strategy="STRICT_PACK") as (pg, actors):
            create(pg, actors, args, bundle=0, gpu_id=0, tp=0)
            with pytest.raises(ray.exceptions.RayActorError) as info:
                ray.get(actors[0].get_info.remote(), timeout=TIMEOUT_S)
    message = str(info.value)
    assert (
        "NUMA node 2 has no CPU cores allowed" in message
        and "skipping NUMA binding for DP0 PP0 TP0." in message
    )
    assert "upstream_standins" not in message


def test_a_group_its_nodes_cannot_plan_in_time_is_a_warning_and_each_actor_places_itself(
    cluster, caplog, monkeypatch
):
    caplog.set_level(
        logging.WARNING, logger="sglang.srt.scheduler_placement.ray_actors"
    )
    monkeypatch.setattr(ray_actors, "PLAN_TIMEOUT_S", 0.0)
    args = PlanArgs(tp_size=1, device="cuda")
    with group(ONE_GPU) as (pg, actors):
        create(pg, actors, args, bundle=0, gpu_id=0, tp=0)
        ((info, binding),) = started(actors)
        with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True):
            ray_actors.forget_group(pg)
            with pytest.raises(
                ray_actors.PlanningError, match="SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1"
            ):
                create(pg, actors, args, bundle=0, gpu_id=0, tp=0)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "could not be planned on the nodes of placement group" in warning
    assert "within 0 s" in warning
    placement = binding["placement"]
    assert placement["reasons"][0].startswith(
        "its placement group could not be planned"
    )
    assert placement["strategy"] == "in-process" and info["cpus"] == [
        cluster.gpu_cpu(ray_gpu(binding))
    ]


def test_a_custom_group_not_reserved_yet_does_not_fail_the_call_and_its_actor_places_itself(
    cluster, caplog, monkeypatch
):
    # RayEngine creates actors in a custom group without waiting for it, as upstream does.
    caplog.set_level(
        logging.WARNING, logger="sglang.srt.scheduler_placement.ray_actors"
    )
    monkeypatch.setattr(ray_actors, "PLAN_TIMEOUT_S", 2.0)
    args = PlanArgs(tp_size=1, device="cuda")
    with group([{"GPU": 4}]) as (blocker, _):
        pending = placement_group(ONE_GPU)
        actors: list = []
        try:
            create(pending, actors, args, bundle=0, gpu_id=0, tp=0)
            remove_placement_group(blocker)
            ((info, binding),) = started(actors)
        finally:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pending)
            ray_actors.forget_group(pending)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert (
        "not reserved within 2 s, so where its bundles are is not known yet" in warning
    )
    placement = binding["placement"]
    assert placement["reasons"][0].startswith(
        "its placement group could not be planned"
    )
    assert placement["pci"] == cluster.gpus[ray_gpu(binding)]
    assert info["cpus"] == [cluster.gpu_cpu(ray_gpu(binding))]


# ----------------------------------------------------------------------------- a plan is reused only when it is the same


def test_two_engines_in_turn_on_one_custom_group_each_start_under_their_own_plan(
    cluster,
):
    seen = []
    with group(ONE_GPU * 2) as (pg, actors):
        for node in (0, 1):
            args = PlanArgs(tp_size=2, device="cuda", numa_node=[node] * 4)
            engine_actors: list = []
            for tp in range(2):
                create(pg, engine_actors, args, bundle=tp, gpu_id=0, tp=tp)
            seen.append(started(engine_actors))
            for actor in engine_actors:  # RayEngine.shutdown
                ray.kill(actor)
            deadline = time.monotonic() + 30
            while leftovers()[0] and time.monotonic() < deadline:
                time.sleep(0.2)
    for node, results in zip((0, 1), seen):
        for info, binding in results:
            assert binding["placement"]["numa_node"] == node
            assert f"node {node} from --numa-node" in " ".join(
                binding["placement"]["reasons"]
            )
            assert info["cpus"] == [cluster.node_cpu[node]]


def test_the_plan_key_holds_everything_the_plan_depends_on():
    from sglang.srt.placement.policy import PlacementPolicy

    class Group:
        class id:
            @staticmethod
            def hex() -> str:
                return "ab" * 14

    def key(**kwargs: Any) -> tuple:
        args = server_args(**{"tp_size": 2, "device": "cuda", **kwargs})
        return ray_actors.plan_key(
            Group, args, PlacementPolicy.from_env(args, launcher="ray")
        )

    assert key() == key()
    assert (
        len(
            {
                key(),
                key(numa_node=[0, 0]),
                key(numa_node=[1, 1]),
                key(device="cpu"),
                key(tp_size=4),
            }
        )
        == 5
    )
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        exclusive = key()
    assert exclusive != key()
