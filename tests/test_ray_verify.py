"""``verify_ray`` on the session's Ray cluster: RayEngine's placement group, ranks and actor calls, with a probe.

The cluster declares 4 GPUs; its raylet's fake /sys puts GPUs 0 and 1 on NUMA
node 0 and GPUs 2 and 3 on node 1, each node holding one real CPU of this
host (``ray_gpu_cluster.two_numa_nodes``). RayEngine reserves one bundle of
all of a node's GPUs; every rank binds itself in-process, for the GPU Ray gave
it.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray_gpu_cluster import GPU_NODE

from sglang.srt.placement.types import PlacementError
from sglang.srt.placement_tools import PlanArgs
from sglang.srt.placement_tools.verify_ray import ray_engine_ranks, verify_ray

pytestmark = pytest.mark.ray

TIMEOUT_S = 180.0


def leftovers() -> tuple[list[str], list[str]]:
    actors = [
        n for n in ray.util.list_named_actors() if n.startswith("sglang_scheduler")
    ]
    table = ray.util.placement_group_table().values()
    return actors, [g["placement_group_id"] for g in table if g["state"] != "REMOVED"]


@pytest.fixture
def cluster(ray_cluster):
    yield ray_cluster
    deadline = time.monotonic() + 30
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])


def check_rank(row: dict, cluster) -> int:
    """The checks every row of this cluster passes; returns the Ray GPU id of the rank."""
    (gpu,) = row["accelerator_ids"]
    gpu = int(gpu)
    assert row["ok"], row["differences"]
    assert row["launcher"] == "ray" and row["gpu_id"] == gpu
    assert row["numbering"] == "physical" and row["numa_node"] == GPU_NODE[gpu]
    assert row["strategy"] == "in-process", row["reasons"]
    assert row["observed_cpus"] == row["cpus"] == str(cluster.gpu_cpu(gpu))
    assert row["actor"].startswith("sglang_scheduler_node")
    return gpu


def test_tp4_every_rank_is_started_by_sglangs_path_for_the_gpu_ray_gave_it(cluster):
    rows = verify_ray(PlanArgs(tp_size=4, device="cuda"), timeout_s=TIMEOUT_S)
    assert [r["tp_rank"] for r in rows] == [0, 1, 2, 3]
    # RayEngine passes each rank its index among the node's GPUs; Ray picks the GPU.
    assert [r["engine_gpu_id"] for r in rows] == [0, 1, 2, 3]
    assert sorted(check_rank(r, cluster) for r in rows) == [0, 1, 2, 3]
    assert all(r["actor"].endswith("_bundle0") for r in rows)


def test_dp2_tp2_ranks_are_started_as_the_data_parallel_controller_starts_them(cluster):
    rows = verify_ray(
        PlanArgs(dp_size=2, tp_size=2, device="cuda"), timeout_s=TIMEOUT_S
    )
    assert [(r["dp_rank"], r["tp_rank"], r["engine_gpu_id"]) for r in rows] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 1, 1),
    ]
    assert sorted(check_rank(r, cluster) for r in rows) == [0, 1, 2, 3]
    assert len({r["actor"] for r in rows}) == 4


def test_rows_of_ranks_not_created_through_create_scheduler_actor_are_not_ok(
    cluster, monkeypatch
):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from sglang.srt.ray import engine

    def bypass(*, pg, bundle_idx, gpu_id, server_args, port_args, tp_rank, pp_rank, dp_rank,
               dist_init_addr, rank0_node_ip):  # fmt: skip
        # The actor class upstream's body uses, created another way.
        return engine.SchedulerActor.options(
            num_cpus=0, num_gpus=1, name=f"sglang_scheduler_bypass_dp{dp_rank}_tp{tp_rank}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_idx),
        ).remote(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, dist_init_addr)  # fmt: skip

    monkeypatch.setattr(engine, "_create_scheduler_actor", bypass)
    rows = verify_ray(PlanArgs(tp_size=2, device="cuda"), timeout_s=TIMEOUT_S)
    for row in rows:
        assert not row["ok"] and row["actor"].startswith("sglang_scheduler_bypass_")
        assert any(
            "it was not created by sglang's _create_scheduler_actor" in d
            for d in row["differences"]
        )


def test_a_probe_that_fails_to_start_fails_verify_with_its_error_and_leaves_nothing(
    cluster,
):
    # --numa-node has an entry for GPU 0 only: the rank Ray gives another GPU fails,
    # as sglang's actor would.
    with pytest.raises(PlacementError) as info:
        verify_ray(
            PlanArgs(tp_size=4, device="cuda", numa_node=[0]), timeout_s=TIMEOUT_S
        )
    message = str(info.value)
    assert (
        message.startswith("DP0 PP0 TP")
        and ": the probe rank failed: SettingError: " in message
    )
    assert "--numa-node has 1 entry (0) but a rank uses GPU" in message
    assert "\n" not in message  # Ray's traceback is left out


def test_a_group_the_cluster_cannot_hold_fails_at_the_deadline_and_leaves_nothing(
    cluster,
):
    started = time.monotonic()
    with pytest.raises(PlacementError) as info:
        verify_ray(PlanArgs(tp_size=8, device="cuda"), timeout_s=3.0)
    assert time.monotonic() - started < 60  # the deadline, plus removing the group
    message = str(info.value)
    assert "[{'CPU': 1, 'GPU': 8}], STRICT_PACK) was not ready within 3 s" in message
    assert "RayEngine asks one GPU per rank" in message


def test_ray_engines_ranks_over_two_nodes_take_each_nodes_gpu_indices():
    ranks = ray_engine_ranks(PlanArgs(tp_size=4, pp_size=2, nnodes=2), [1, 0])
    assert [(r.pp_rank, r.tp_rank, r.device.index, b) for r, b in ranks] == [
        (0, 0, 0, 1),
        (0, 1, 1, 1),
        (0, 2, 2, 1),
        (0, 3, 3, 1),
        (1, 0, 0, 0),
        (1, 1, 1, 0),
        (1, 2, 2, 0),
        (1, 3, 3, 0),
    ]
