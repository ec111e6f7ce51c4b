"""sglang's Ray scheduler actors place themselves, on a local cluster of three raylets.

One cluster for the module (``ray_gpu_cluster``): its GCS, raylets and workers run on
a fake host of two NUMA nodes, GPUs 0 and 1 on node 0 and GPUs 2 and 3 on node 1,
each node holding one real CPU of this machine. The raylets:

* ``a`` declares 2 GPUs (Ray ids 0 and 1); its NVML lists the host's four; it runs
  with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (as upstream's benchmark
  does), so its actors see every GPU.
* ``b`` declares 2 GPUs under ``CUDA_VISIBLE_DEVICES=2,3`` (Ray ids 2 and 3); Ray
  narrows each actor's ``CUDA_VISIBLE_DEVICES`` to its GPU.
* ``c`` is a container given host GPUs 3 and 0: its NVML lists only those, in that
  order, and it numbers them 0 and 1 (``CUDA_VISIBLE_DEVICES=0,1``, Ray ids 0 and 1;
  narrowed too).

The jobs run at once, each a Ray job with its own settings. Their actors are sglang's
``SchedulerActor``, created by sglang's ``_create_scheduler_actor``, whose
``Scheduler`` alone is stood in (``ray_scheduler_standin``): built after
``configure_scheduler_process``, it reports every thread's CPUs, the memory policy,
the ``gpu_id`` the actor published and what the core logged.

``RAY_TESTS_PACKAGE=pristine`` runs every job on pristine sglang 0.5.23 instead, to
see these tests fail there.
"""

from __future__ import annotations

import os
import re

import pytest
from ray_gpu_cluster import GPU_NODE, nvml_gpus, run_plan

pytestmark = pytest.mark.ray

PACKAGE = os.environ.get("RAY_TESTS_PACKAGE", "overlaid")
REAL = sorted(os.sched_getaffinity(0))
NODE_CPU = {0: REAL[0], 1: REAL[1]}
"""The one CPU of this machine a rank bound to a fake node runs on."""
CONTAINER_GPUS = [3, 0]
"""Host GPUs of raylet c, by its own (NVML, CUDA and Ray) numbering."""
NUMA_NODE = [1, 1, 0, 0]
"""The --numa-node of the numa_node job: by Ray GPU id, never what discovery says."""
OMP_GROUPS = [REAL[1], REAL[0]]
"""SGLANG_CPU_OMP_THREADS_BIND of the cpu job: rank 0 on the second CPU."""

_CUDA_HOST = {"PLACEMENT_TESTS_PLATFORM": "cuda"}
PLAN = {
    "raylets": [
        {"name": "a", "num_gpus": 2,
         "env": {"FAKE_NVML_GPUS": nvml_gpus([0, 1, 2, 3]), **_CUDA_HOST,
                 "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        {"name": "b", "num_gpus": 2,
         "env": {"FAKE_NVML_GPUS": nvml_gpus([0, 1, 2, 3]), **_CUDA_HOST,
                 "CUDA_VISIBLE_DEVICES": "2,3"}},
        {"name": "c", "num_gpus": 2,
         "env": {"FAKE_NVML_GPUS": nvml_gpus(CONTAINER_GPUS), **_CUDA_HOST,
                 "CUDA_VISIBLE_DEVICES": "0,1"}},
    ],
    "jobs": [
        {"name": "engine", "package": PACKAGE,
         "server_args": {"tp_size": 4, "device": "cuda"},
         "actors": [{"raylet": r, "tp_rank": i} for i, r in enumerate("aabb")]},
        {"name": "container", "package": PACKAGE,
         "server_args": {"tp_size": 2, "device": "cuda"},
         "actors": [{"raylet": "c", "tp_rank": i} for i in range(2)]},
        {"name": "numa_node", "package": PACKAGE,
         "server_args": {"tp_size": 1, "device": "cuda", "numa_node": NUMA_NODE},
         "actors": [{"raylet": "b", "tp_rank": 0}]},
        # A CPU host: no CUDA platform; RayEngine still asks one GPU per actor.
        {"name": "cpu", "package": PACKAGE,
         "env_vars": {"PLACEMENT_TESTS_PLATFORM": "",
                      "SGLANG_CPU_OMP_THREADS_BIND": "|".join(map(str, OMP_GROUPS))},
         "server_args": {"tp_size": 2, "device": "cpu"},
         "actors": [{"raylet": "c", "tp_rank": i} for i in range(2)]},
    ],
}  # fmt: skip
_PLACEMENT = re.compile(
    r"INFO Scheduler of Ray GPU (\d+): ProcessPlacement\(strategy='([\w-]+)', "
    r"node=(\w+), cpus=\(([\d, ]*)\), mem_policy='(\w+)'"
)


@pytest.fixture(scope="module")
def jobs() -> dict:
    """Every job's actor reports, from one cluster."""
    return run_plan(PLAN)["jobs"]


def _ok(reports: list[dict]) -> list[dict]:
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, "\n".join(errors)
    return reports


def _ray_gpu(report: dict) -> int:
    [gpu] = report["ray_gpu_ids"]  # one GPU per actor (_create_scheduler_actor)
    return gpu


def _placement(report: dict) -> tuple:
    """(Ray GPU id, strategy, node, CPUs, memory policy) as the core logged it."""
    [line] = [m for m in map(_PLACEMENT.match, report["placement_log"]) if m]
    gpu, strategy, node, cpus, mem = line.groups()
    return int(gpu), strategy, int(node), [int(c) for c in cpus.split(",") if c], mem


def _assert_bound(report: dict, node: int) -> None:
    """The actor bound itself to ``node`` in-process: every thread on the node's CPU,
    memory preferred there (where this host has it: node 0 only)."""
    cpu = NODE_CPU[node]
    assert _placement(report) == (
        _ray_gpu(report),
        "in-process",
        node,
        [cpu],
        "preferred",
    )
    assert {tuple(c) for c in report["thread_cpus"].values()} == {(cpu,)}
    assert len(report["thread_cpus"]) > 1  # Ray's worker runs several threads
    # libnuma's numa_set_preferred(1) is refused by this kernel (no node 1 memory).
    assert report["mempolicy"] == (["preferred", [0]] if node == 0 else ["default", []])


def test_actors_on_ray_gpus_0_to_3_of_two_raylets_bind_every_thread_to_their_node(jobs):
    reports = _ok(jobs["engine"])
    assert {(r["raylet"], _ray_gpu(r)) for r in reports} == {
        ("a", 0), ("a", 1), ("b", 2), ("b", 3)
    }  # fmt: skip
    for report in reports:
        _assert_bound(report, GPU_NODE[_ray_gpu(report)])
        # sglang's own actor, created by its own _create_scheduler_actor.
        assert report["built_by"].endswith("sglang/srt/ray/scheduler_actor.py:__init__")
        assert report["actor_name"].startswith(
            f"sglang_scheduler_node127.0.0.1_dp0_pp0_tp{report['tp_rank']}_pg"
        )


def test_the_published_gpu_id_is_the_cuda_index_the_actor_sees(jobs):
    """So ``torch.cuda.set_device(get_device().gpu_id)`` in ``run_event_loop`` finds
    the actor's own GPU; before the change it was Ray's id, beyond the one device a
    narrowed actor sees for any id but 0."""
    reports = _ok(jobs["engine"]) + _ok(jobs["container"])
    for report in reports:
        gpu, published = _ray_gpu(report), report["published_gpu_id"]
        if report["raylet"] == "a":  # not narrowed: Ray's id is CUDA's
            assert report["cuda_visible_devices"] is None
            assert (published, report["cuda_device_count"]) == (gpu, 4)
        else:  # narrowed to its one GPU: CUDA index 0
            assert report["cuda_visible_devices"] == str(gpu)
            assert (published, report["cuda_device_count"]) == (0, 1)
    assert {_ray_gpu(r) for r in reports if r["raylet"] != "a"} == {0, 1, 2, 3}


def test_a_raylet_given_some_of_the_hosts_gpus_places_each_actor_by_its_own_gpu(jobs):
    reports = _ok(jobs["container"])
    assert sorted(_ray_gpu(r) for r in reports) == [0, 1]
    for report in reports:
        host_gpu = CONTAINER_GPUS[_ray_gpu(report)]
        _assert_bound(report, GPU_NODE[host_gpu])


def test_numa_node_is_read_by_ray_gpu_id(jobs):
    [report] = _ok(jobs["numa_node"])
    gpu = _ray_gpu(report)
    assert gpu in (2, 3) and report["published_gpu_id"] == 0
    # Neither discovery (node 1) nor the CUDA index (NUMA_NODE[0] == 1) says node 0.
    _assert_bound(report, NUMA_NODE[gpu])


def test_cpu_device_actors_bind_to_their_omp_group(jobs):
    reports = _ok(jobs["cpu"])
    assert sorted(_ray_gpu(r) for r in reports) == [0, 1]
    for report in reports:
        cpu = OMP_GROUPS[_ray_gpu(report)]  # the rank's group, by Ray's GPU id
        [node] = [n for n, node_cpu in NODE_CPU.items() if node_cpu == cpu]
        _assert_bound(report, node)


def test_bootstrap_gives_a_cpu_actors_openmp_threads_the_group_it_bound_itself_to(
    jobs,
):
    # What bootstrap's _bind_threads_if_cpu returns in the actor: the CPUs that the
    # kernel's init_cpu_threads_env then pins the rank's OpenMP threads to.
    for report in _ok(jobs["cpu"]):
        assert report["omp_cpus"] == str(OMP_GROUPS[_ray_gpu(report)])
