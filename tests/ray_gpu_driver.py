"""A Ray driver for the GPU-path tests: joins the cluster RAY_ADDRESS names, runs scenarios, prints one JSON object.

Run: python tests/ray_gpu_driver.py SCENARIO [SCENARIO ...]  (see SCENARIOS). Each test process has
already called ray.init for its CPU-only cluster, so GPU scenarios run in this separate driver.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import ray_helpers
from sglang.srt.placement.verify import probe_target
from sglang.srt.scheduler_rank.common import Deadline
from sglang.srt.scheduler_launch.ray_launcher import (
    RayLaunch,
    launch_scheduler_actors,
    plan_actor_starts,
    shutdown_ray,
    start_actors,
    wait_ready_ray,
)
from sglang.srt.scheduler_launch.ray_sites import discover_sites
from sglang.srt.placement.engine_args import EngineArgs

TIMEOUT_S = 90.0


@ray.remote(num_cpus=0)
class GpuHolder:
    """An actor that only says which GPU ids Ray gave it."""

    def ids(self) -> list[str]:
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]]


def one_gpu_bundles() -> dict:
    """Per 1-GPU bundle: the id a probe holding the bundle's GPU saw, and the id an actor created there got."""
    group = placement_group([{"GPU": 1}] * 4, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=TIMEOUT_S)
        sites = discover_sites(group, range(4), resource="GPU", deadline=Deadline(TIMEOUT_S))
        holders = [GpuHolder.options(num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=i)).remote() for i in range(4)]
        actor_ids = ray.get([h.ids.remote() for h in holders], timeout=TIMEOUT_S)
        for h in holders:
            ray.kill(h)
        return {"probe_ids": [list(sites[i].accelerator_ids) for i in range(4)], "actor_ids": actor_ids}
    finally:
        remove_placement_group(group)


def rows(launch: RayLaunch, results: list) -> list[dict]:
    return [{**r.placement.to_dict(), "actor_gpu": a.binding["accelerator_ids"], "actor_node": a.binding["node_id"],
             "mismatches": a.binding["mismatches"], "observed_cpus": a.binding["observed"]["cpus"]}
            for a, r in zip(launch.actors, results)]


def two_gpu_bundle(affinity_mode: str) -> dict:
    """Upstream's shape: one bundle of two GPUs holding two ranks; Ray picks each actor's GPU as it starts."""
    server_args = EngineArgs(tp_size=2, device="cuda")
    group = placement_group([{"GPU": 2}], strategy="STRICT_PACK")
    launch = RayLaunch(placement_group=group)
    try:
        ray.get(group.ready(), timeout=TIMEOUT_S)
        from sglang.srt.placement.resolve import local_ranks

        ranks = [(rank, 0) for rank in local_ranks(server_args)]
        starts, plans = plan_actor_starts(group, ranks, server_args, deadline=Deadline(TIMEOUT_S),
                                          affinity_mode=affinity_mode)
        launch.plans = plans
        launch.actors = start_actors(group, starts, server_args, target=probe_target)
        results = wait_ready_ray(launch, timeout_s=TIMEOUT_S)
        candidates = [[[i, p.pci, p.strategy.value, sorted(p.cpus)] for i, p in start.candidates]
                      for _, start, _ in starts]
        return {"candidates": candidates, "py_executables": [e for _, _, e in starts], "ranks": rows(launch, results)}
    finally:
        shutdown_ray(launch)


def exclusive_on_cpus_this_host_lacks() -> dict:
    """tp=4 exclusive on a node whose tree has 8 CPUs on the GPUs' node (this host has fewer), planned with the
    tree's CPUs as allowed: the slices are the tree's; ranks whose CPUs this host lacks cannot really bind."""
    launch = launch_scheduler_actors(EngineArgs(tp_size=4, device="cuda"), target=probe_target, timeout_s=TIMEOUT_S,
                                     planner=ray_helpers.tree_cpus_planner, affinity_mode="exclusive")
    try:
        return {"ranks": rows(launch, wait_ready_ray(launch, timeout_s=TIMEOUT_S))}
    finally:
        shutdown_ray(launch)


SCENARIOS = {
    "one_gpu_bundles": one_gpu_bundles,
    "two_gpu_bundle_node": lambda: two_gpu_bundle("node"),
    "two_gpu_bundle_exclusive": lambda: two_gpu_bundle("exclusive"),
    "exclusive_on_cpus_this_host_lacks": exclusive_on_cpus_this_host_lacks,
}


def main() -> None:
    ray.cloudpickle.register_pickle_by_value(ray_helpers)
    ray.init(address=os.environ["RAY_ADDRESS"], configure_logging=False, log_to_driver=False)
    out = {}
    try:
        for name in sys.argv[1:]:
            started = time.perf_counter()
            out[name] = SCENARIOS[name]()
            out[name]["wall_s"] = time.perf_counter() - started
        out["leftover_actors"] = [n for n in ray.util.list_named_actors() if n.startswith("sglang_scheduler")]
        out["leftover_groups"] = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
